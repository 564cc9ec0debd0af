"""kvrepro.accuracy_vllm and scripts/vllm_accuracy.py on CPU: the committed prompt bundle holds exactly
the CPU path's prompt ids (hashes equal to the committed CPU results), the decode table equals the
tokenizer, and the per-mode subprocess orchestration runs end to end with a fake engine (environment per
mode, a failing mode recorded while the others run, a timeout keeping finished phases, CSV/JSON outputs).

The fake engine (``fake_engine``) is loaded by the worker subprocesses as ``test_accuracy_vllm:fake_engine``.
It answers each passkey prompt with the FIRST 5-digit number of the prompt (so: right on single-needle
prompts, right on multi-needle prompts only when the asked vault's needle comes first), continues sanity
prompts with the prompt's own first tokens, and misbehaves on demand through FAKE_* variables
(FAKE_LOSE=<mode>:<k>: that mode answers its first k single-needle prompts wrong).
"""
import gzip
import hashlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pandas as pd
import pytest

import scripts_module
from kvrepro import accuracy, accuracy_vllm as av
from kvrepro import needle
from kvrepro.needle import build_prompt, ids_sha256

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve().parent
FACTORY = "test_accuracy_vllm:fake_engine"


# ---------------------------------------------------------------- the fake engine (runs in worker subprocesses)

class FakeEngine:
    def __init__(self, mode, model, **kw):
        want = mode.split(":", 1)[1] if mode.startswith("kvrepro:") else None
        if os.environ.get("KVREPRO_PRESET") != want:
            raise RuntimeError(f"KVREPRO_PRESET={os.environ.get('KVREPRO_PRESET')!r} for mode {mode}")
        if os.environ.get("FAKE_FAIL") == mode:
            raise RuntimeError("fake engine refuses to start")
        with gzip.open(os.environ["FAKE_BUNDLE"], "rt") as f:  # the decode table, to answer in token ids
            self.table = json.load(f)["token_table"]
        self.digit_id = {self.table.index(c): c for c in "0123456789"}
        self.mode, self.info = mode, {"fake": True, "compile": kw.get("compile")}
        if "CUDA_VISIBLE_DEVICES" in os.environ:   # run_modes(gpus=...): the GPU the mode ran on, and when
            self.info["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
        self.lose = 0
        if os.environ.get("FAKE_LOSE", "").rpartition(":")[0] == mode:
            self.lose = int(os.environ["FAKE_LOSE"].rpartition(":")[2])
        # FAKE_STUCK=gguf: a broken GGUF load that answers one token to everything (seen on the H200)
        self.stuck = os.environ.get("FAKE_STUCK") == "gguf" and str(model).endswith(".gguf")

    def generate(self, prompts, max_tokens, stop_ids=(), ignore_eos=False):
        if ignore_eos:  # sanity prompts
            if os.environ.get("FAKE_CORRUPT") == self.mode:
                return [[p[0]] * max_tokens for p in prompts]
            return [p[:max_tokens] for p in prompts]
        if self.stuck:
            return [[49151] * max_tokens for _ in prompts]
        if os.environ.get("FAKE_SLEEP_S"):   # and record when, in FAKE_TIMES/<mode>.json
            t0 = time.time()
            time.sleep(float(os.environ["FAKE_SLEEP_S"]))
            with open(os.path.join(os.environ["FAKE_TIMES"], self.mode.replace(":", "_") + ".json"), "w") as f:
                json.dump([t0, time.time()], f)
        outs = []
        for p in prompts:
            run = []
            for t in p:  # the first run of exactly 5 digit tokens
                if t in self.digit_id:
                    run.append(t)
                elif len(run) == 5:
                    break
                else:
                    run = []
            if self.lose and len(outs) < self.lose:
                run = run[:1] + run[:4]   # wrong: the first digit twice
            outs.append((run + [self.table.index("."), stop_ids[0]])[:max_tokens])
        return outs

    def prompt_logprobs(self, prompts, n_last):
        if os.environ.get("FAKE_LP_FAIL") == self.mode:
            raise KeyError("no prompt logprobs")
        if os.environ.get("FAKE_SLOW") == self.mode:
            time.sleep(60)
        return [[-0.25] * n for n in n_last]


def fake_engine(mode, model, **kw):
    return FakeEngine(mode, model, **kw)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tok():
    from kvrepro.hf import load_smollm2

    return load_smollm2()[1]


@pytest.fixture(scope="module")
def small_bundle(tok, tmp_path_factory):
    grid = av.VllmGrid(context_lengths=(256,), depths=(0.0, 1.0), num_keys=2, sanity_tokens=8)
    return av.save_bundle(av.build_bundle(tok, grid), str(tmp_path_factory.mktemp("b") / "bundle.json.gz"))


ROOMS3 = ["room 1204", "room 1240", "room 1024"]
# enough single-needle pairs for a verdict (>= kvrepro.stats.min_pairs() = 368) at 256 tokens, plus a multi-needle
# set with near-duplicate room names and two long sanity prompts
STAT_GRID = av.VllmGrid(context_lengths=(256,), depths=tuple(round(i / 23, 3) for i in range(24)), num_keys=16,
                        sanity_tokens=8, multi=({"name": "room-3", "needles": 3, "key_names": ROOMS3, "num_keys": 1},),
                        sanity_lengths=(256, 300))


@pytest.fixture(scope="module")
def stat_bundle(tok, tmp_path_factory):
    return av.save_bundle(av.build_bundle(tok, STAT_GRID), str(tmp_path_factory.mktemp("s") / "stat.json.gz"))


@pytest.fixture()
def fake_env(monkeypatch, small_bundle):
    monkeypatch.setenv("FAKE_BUNDLE", small_bundle)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("FAKE_FAIL", "FAKE_CORRUPT", "FAKE_SLOW", "FAKE_LP_FAIL", "FAKE_STUCK", "FAKE_LOSE", "FAKE_SLEEP_S",
              "FAKE_TIMES", "KVREPRO_PRESET", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# ---------------------------------------------------------------- prompts are the CPU path's, byte for byte

def test_committed_bundle_matches_cpu_prompts_and_results(tok):
    b = av.load_bundle(str(ROOT / av.BUNDLE_PATH))  # checks every prompt's ids against its sha256
    assert len(b["prompts"]) == len(b["grid"]["context_lengths"]) * len(b["grid"]["depths"]) * \
        b["grid"]["num_keys"] * len(b["grid"]["variants"])
    by_cell = {(p["variant"], p["context_length"], p["depth"], p["key"]): p for p in b["prompts"]}
    # the committed CPU results: same prompt bytes on the shared cells (1K-4K, depths 0/0.33/0.67/1, 2 keys)
    cpu = pd.read_csv(ROOT / "results" / "accuracy" / "03_default.csv", dtype={"key": str})
    cpu = cpu[cpu["format"] == "bf16"]
    for _, r in cpu.iterrows():
        assert by_cell[("single", r["context_length"], r["depth"], r["key"])]["prompt_sha256"] == r["prompt_sha256"]
    # rebuilt now with the CPU path's tokenizer: identical ids (a sample: the longest prompts of each variant)
    for v in ("single", "multi"):
        p = by_cell[(v, max(b["grid"]["context_lengths"]), 0.5, p_key(b))]
        q = build_prompt(tok, p["context_length"], p["depth"], p["key"], v)
        assert q.input_ids == p["input_ids"] and q.answer_ids == p["answer_ids"]
        # bundles before the key-name parameter record the vault letter ("A"), newer ones the name ("vault-A")
        assert q.vault == (p["vault"] if p["vault"] in ("", *needle.VAULT_NAMES) else f"vault-{p['vault']}")
        assert p["n_tokens"] + b["grid"]["max_new_tokens"] <= av.MAX_MODEL_LEN
    assert b["eos_token_id"] == tok.eos_token_id
    assert b["meta"]["model_sha256"] and b["meta"]["model_bytes"] > 50e6


def p_key(b):
    return av.make_keys(b["grid"]["num_keys"], b["grid"]["seed"])[-1]


def test_decode_table_equals_the_tokenizer(tok):
    b = av.load_bundle(str(ROOT / av.BUNDLE_PATH))
    table = b["token_table"]
    assert len(table) == len(tok)
    for s in b["sanity"]:
        ids = s["input_ids"][-60:]
        assert av.decode_ids(table, ids) == tok.decode(ids, skip_special_tokens=True)
    for text in ("60494.", "The pass key is 65125<|im_end|>", " 4821 3"):
        ids = tok(text, add_special_tokens=False).input_ids
        assert av.decode_ids(table, ids) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kw,name", [(dict(context_lengths=(8190,)), "context_lengths"),
                                     (dict(variants=("single", "triple")), "variants"),
                                     (dict(max_new_tokens=2), "max_new_tokens"), (dict(depths=(2,)), "depths"),
                                     (dict(sanity_tokens=4), "sanity_tokens"), (dict(num_keys=0), "num_keys"),
                                     (dict(multi=({"name": "x", "needles": 1},)), "needles must be an integer >= 2"),
                                     (dict(multi=({"name": "x", "colour": 1},)),
                                      r"multi: unknown key\(s\) \['colour'\]"),
                                     (dict(multi=({"needles": 3},)), "multi: every set needs a name"),
                                     (dict(multi=({"name": "a"}, {"name": "a"})), "set names must be distinct"),
                                     (dict(multi=({"name": "r", "needles": 2, "key_names": ["r 1", "r 1"]},)),
                                      "key_names has duplicates"),
                                     (dict(multi=({"name": "v", "value_digits": 1},)), "value_digits"),
                                     (dict(multi=({"name": "v", "num_keys": 0},)), "num_keys"),
                                     (dict(multi=()), "multi must be a list"),
                                     (dict(sanity_lengths=(8190,)), "sanity_lengths"),
                                     (dict(haystack="novels"), "haystack must be 'filler' or a corpus")])
def test_grid_validation_names_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        av.VllmGrid(**kw).validate()


def test_modes_validation():
    assert av.check_modes("bf16,kvrepro:k4v4") == ("bf16", "kvrepro:k4v4")
    with pytest.raises(ValueError, match="modes: unknown.*allowed"):
        av.check_modes(["bf16", "kvrepro:k3v3"])
    env = av.mode_env("kvrepro:k4v2", {"KVREPRO_PRESET": "k4v4", "X": "1"})
    assert env["KVREPRO_PRESET"] == "k4v2" and env["X"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "KVREPRO_PRESET" not in av.mode_env("fp8", {"KVREPRO_PRESET": "k4v4"})


def test_control_mode_is_bf16_through_another_kernel():
    """``bf16:triton_attn``: the bf16 KV cache (no kvrepro preset in the environment) through vLLM's TRITON_ATTN
    backend, recorded as its own format so ``target_check`` judges it against bf16 like any format."""
    assert av.check_modes("bf16,bf16:triton_attn") == ("bf16", "bf16:triton_attn")
    assert av.mode_settings("bf16:triton_attn") == {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN",
                                                   "env": {}}
    assert av.mode_settings("kvrepro:k4v4")["attention_backend"] == "CUSTOM"
    assert av.mode_settings("bf16")["attention_backend"] is None
    assert "KVREPRO_PRESET" not in av.mode_env("bf16:triton_attn", {"KVREPRO_PRESET": "k4v4"})
    assert av.FORMAT_OF_MODE["bf16:triton_attn"] == "bf16-triton_attn"
    assert set(av.FORMAT_OF_MODE) == set(av.MODES)
    with pytest.raises(ValueError, match="modes: unknown"):
        av.mode_settings("bf16:flashinfer")


def test_tampered_bundle_is_refused(small_bundle, tmp_path):
    with gzip.open(small_bundle, "rt") as f:
        b = json.load(f)
    b["prompts"][0]["input_ids"][5] += 1
    bad = av.save_bundle(b, str(tmp_path / "bad.json.gz"))
    with pytest.raises(ValueError, match="do not match their sha256"):
        av.load_bundle(bad)


# ---------------------------------------------------------------- orchestration with the fake engine

def first_number_is_target(tok, p) -> bool:
    """Independent of the fake: does the asked key come first among the prompt's 5-digit numbers?"""
    return re.search(r"\d{5}", tok.decode(p["input_ids"])).group(0) == p["key"]


def test_run_modes_with_fake_engine(tok, small_bundle, tmp_path, fake_env):
    fake_env.setenv("FAKE_FAIL", "kvrepro:k8v4")
    fake_env.setenv("FAKE_CORRUPT", "kvrepro:k4v2")
    fake_env.setenv("FAKE_LP_FAIL", "kvrepro:k4v2")
    done = []
    res = av.run_modes(["bf16", "kvrepro:k4v4", "kvrepro:k8v4", "kvrepro:k4v2"], small_bundle, small_bundle,
                       str(tmp_path / "w"), factory=FACTORY, engine_kw={"compile": "eager"}, weights="dequant",
                       mode_timeout_s=60, deadline_s=240, on_mode_done=lambda r: done.append(len(r["status"])))
    assert done == [1, 2, 3, 4]
    st = res["status"]
    assert [st[m]["status"] for m in ("bf16", "kvrepro:k4v4", "kvrepro:k8v4", "kvrepro:k4v2")] == \
        ["ok", "ok", "failed", "ok"]
    assert st["kvrepro:k8v4"]["phase"] == "engine" and "refuses to start" in st["kvrepro:k8v4"]["log_tail"]
    assert st["bf16"]["info"] == {"fake": True, "compile": "eager", "key_logprobs": "all"}
    df = pd.DataFrame(res["rows"])
    b = av.load_bundle(small_bundle)
    assert len(df) == 3 * len(b["prompts"]) and set(df["format"]) == {"bf16", "k4v4", "k4v2"}
    truth = {p["prompt_sha256"]: int(first_number_is_target(tok, p)) for p in b["prompts"]}
    assert all(truth[p["prompt_sha256"]] == 1 for p in b["prompts"] if p["variant"] == "single")
    assert 0 < sum(truth.values()) < len(truth)  # some multi-needle prompts put a distractor first
    assert (df["correct"] == df["prompt_sha256"].map(truth)).all()
    wrong = df[df["correct"] == 0]
    assert (wrong["answer_kind"] == "distractor").all() and (wrong["variant"] == "multi").all()
    assert (df["engine"] == "vllm").all()
    # kvrepro rows store the settings the engine resolved (kvrepro.vllm_backend.runtime.settings_record)
    ks = json.loads(df[df["format"] == "k4v4"]["kvrepro_settings"].iloc[0])
    assert ks["preset"] == "k4v4" and ks["decode_impl_setting"] == "auto" and ks["store_rotate"] == "kernel"
    assert json.loads(df[df["format"] == "k4v2"]["kvrepro_settings"].iloc[0])["preset"] == "k4v2"
    assert (df[df["format"] == "bf16"]["kvrepro_settings"] == "").all()
    # a failing margin phase is recorded, the retrieval rows stay and the mode still counts as run
    assert st["kvrepro:k4v2"]["phase_errors"] == ["teacher-forced: KeyError('no prompt logprobs')"]
    assert df[df["format"] == "k4v2"]["key_logprob_mean"].isna().all()
    assert (df[df["format"] != "k4v2"]["key_logprob_mean"] == -0.25).all() and st["bf16"]["phase_errors"] == []
    # sanity: the corrupting mode fails the stated thresholds, the faithful one passes
    t = accuracy.sanity_table(pd.DataFrame(res["sanity"]))
    assert t.loc["k4v4", "sanity_pass"] and t.loc["k4v4", "token_agreement"] == 1.0
    assert not t.loc["k4v2", "sanity_pass"] and t.loc["k4v2", "dup_rate"] == 1.0


def test_weights_dequant_and_degenerate_output(small_bundle, tmp_path, fake_env):
    """weights='dequant' runs every mode on the de-quantized directory (called once, up front); a
    GGUF load answering one repeated token fails its mode and drops its rows (gguf), or switches to
    the de-quantized weights (auto); the worker refuses 'dequant' rows served from a .gguf file."""
    fake_env.setenv("FAKE_STUCK", "gguf")
    gguf = str(tmp_path / "m.gguf")
    calls = []

    def fake_dequant(m):
        calls.append(m)
        os.makedirs(tmp_path / "hf", exist_ok=True)
        return str(tmp_path / "hf")

    kw = dict(factory=FACTORY, mode_timeout_s=60, deadline_s=200, dequant=fake_dequant)
    res = av.run_modes(["bf16", "fp8"], small_bundle, gguf, str(tmp_path / "w1"), weights="dequant", **kw)
    n = len(av.load_bundle(small_bundle)["prompts"])
    assert calls == [gguf] and res["model"] == str(tmp_path / "hf") and res["weights"] == "dequant"
    assert [s["status"] for s in res["status"].values()] == ["ok", "ok"] and len(res["rows"]) == 2 * n
    assert {r["weights"] for r in res["rows"]} == {"dequant"} and sum(r["correct"] for r in res["rows"]) > 0
    res = av.run_modes(["bf16", "fp8"], small_bundle, gguf, str(tmp_path / "w2"), weights="gguf", **kw)
    assert [s["status"] for s in res["status"].values()] == ["failed", "failed"] and res["rows"] == []
    assert res["status"]["bf16"]["error"] == f"degenerate output: {n}/{n} prompts answered one or two repeated " \
                                             "tokens (most often id 49151); broken model load?"
    res = av.run_modes(["bf16", "fp8"], small_bundle, gguf, str(tmp_path / "w3"), weights="auto", **kw)
    assert [s["status"] for s in res["status"].values()] == ["ok", "ok"] and res["weights"] == "dequant"
    assert "degenerate output" in res["weights_note"] and calls == [gguf, gguf]
    with pytest.raises(ValueError, match="weights='dequant' but model="):
        av.run_worker("bf16", small_bundle, str(tmp_path / "M.GGUF"), str(tmp_path / "o.json"), factory=FACTORY,
                      weights="dequant")
    with pytest.raises(ValueError, match="weights='gguf' but model=.* not a .gguf file"):
        av.run_worker("bf16", small_bundle, str(tmp_path / "hf"), str(tmp_path / "o.json"), factory=FACTORY,
                      weights="gguf")
    dg = av.degenerate_output
    assert dg([{"output_ids": "5 5 5 5"}, {"output_ids": "1 2 3 4"}]) == ""
    assert dg([{"output_ids": "5 5 5"}] * 3) == "" and dg([]) == ""  # too short to call stuck; nothing to judge
    assert dg([{"output_ids": "7 7 7 7 7 7 7 2"}] * 2).startswith("degenerate output: 2/2 prompts")  # then EOS
    assert dg([{"output_ids": [7, 8, 7, 8, 7, 8]}] * 2).startswith("degenerate output: 2/2 prompts")  # 2-token loop
    assert dg([{"output_ids": "2"}, {"output_ids": ""}]) == \
        "degenerate output: 2/2 prompts answered at most one token; broken model load?"
    assert dg([{"output_ids": [38, 32, 36, 41, 36, 30, 2]}] * 2) == ""  # "60494." + EOS


def test_timeout_keeps_finished_phases_and_deadline_skips(small_bundle, tmp_path, fake_env):
    fake_env.setenv("FAKE_SLOW", "fp8")
    res = av.run_modes(["fp8", "bf16"], small_bundle, small_bundle, str(tmp_path / "w"), factory=FACTORY,
                       mode_timeout_s=12, deadline_s=30, weights="dequant")
    s = res["status"]
    assert s["fp8"]["status"] == "failed" and s["fp8"]["error"].startswith("timeout")
    assert s["fp8"]["phase"] == "teacher-forced"  # greedy + sanity rows were written before the kill
    assert len(res["rows"]) == len(av.load_bundle(small_bundle)["prompts"])
    assert s["bf16"]["status"] == "skipped" and "time budget" in s["bf16"]["error"]


def test_modes_come_from_the_preset_registry(monkeypatch):
    """A compressed preset added to kvrepro.formats is a mode here, with no change to accuracy_vllm."""
    from kvrepro import formats

    modes = av.default_modes()
    assert modes[:3] == ("bf16", f"kvrepro:{formats.DEFAULT_PRESET}", "fp8") and modes[-1] == "bf16:triton_attn"
    assert sorted(modes[1:2] + modes[3:-1]) == sorted(f"kvrepro:{p}" for p in formats.COMPRESSED_PRESETS)
    assert {"kvrepro:k4v4", "kvrepro:k8v4", "kvrepro:k4v2"} <= set(modes) and len(set(modes)) == len(modes)
    monkeypatch.setitem(formats.COMPRESSED_PRESETS, "k3v3", (3, 3))
    monkeypatch.setattr(formats, "DEFAULT_PRESET", "k8v4")
    assert av.check_modes("bf16,kvrepro:k3v3") == ("bf16", "kvrepro:k3v3")
    assert av.mode_settings("kvrepro:k3v3") == {"kv_cache_dtype": "auto", "attention_backend": "CUSTOM",
                                                "env": {"KVREPRO_PRESET": "k3v3"}}
    assert av.mode_env("kvrepro:k3v3", {})["KVREPRO_PRESET"] == "k3v3" and av.format_of_mode("kvrepro:k3v3") == "k3v3"
    assert av.default_modes() == ("bf16", "kvrepro:k8v4", "fp8",       # the rest in the registry's order
                                  *(f"kvrepro:{p}" for p in formats.COMPRESSED_PRESETS if p != "k8v4"),
                                  "bf16:triton_attn")
    assert av.default_modes()[-2] == "kvrepro:k3v3"
    monkeypatch.delitem(formats.COMPRESSED_PRESETS, "k3v3")
    with pytest.raises(ValueError, match="modes: unknown"):
        av.check_modes("kvrepro:k3v3")


def test_named_grids():
    """"stat": >= 1,000 single-needle and >= 500 multi-needle prompts per mode, 1K to SmolLM2's window minus the
    answer, depths 0..1, many keys, a multi set with near-duplicate room names; "default": the committed bundle."""
    g = av.GRIDS["stat"]
    g.validate()
    cells = len(g.context_lengths) * len(g.depths)
    sets = g.multi_sets()
    assert cells * g.num_keys >= 1000 and cells * sum(s["num_keys"] for s in sets) >= 500
    assert g.prompts() == cells * (g.num_keys + sum(s["num_keys"] for s in sets))
    assert min(g.context_lengths) == 1024 and max(g.context_lengths) == av.MAX_MODEL_LEN - g.max_new_tokens
    assert g.depths[0] == 0.0 and g.depths[-1] == 1.0 and len(g.depths) >= 11
    rooms = [s for s in sets if s["key_names"] != list(needle.default_key_names(s["needles"]))]
    assert rooms and all(sorted(n[-4:]) == sorted(rooms[0]["key_names"][0][-4:]) for n in rooms[0]["key_names"])
    assert max(g.sanity_lengths) + g.sanity_tokens <= av.MAX_MODEL_LEN
    committed = av.load_bundle(str(ROOT / av.BUNDLE_PATH))["grid"]
    assert {k: v for k, v in av.GRIDS["default"].as_dict().items() if k in committed} == committed
    assert av.VllmGrid.from_dict(av.GRIDS["stat"].as_dict()) == av.VllmGrid.from_dict(g.as_dict())
    with pytest.raises(ValueError, match=r"unknown grid parameter\(s\) \['colour'\]"):
        av.VllmGrid.from_dict({"colour": 1})


def test_committed_stat_bundle_is_the_stat_grid(tok):
    """results/accuracy/vllm_prompts_stat.json.gz (build-bundle --grid stat) holds the "stat" grid's prompts as the
    current code builds them (a sample rebuilt), each once; every prompt fits the model's window with its answer."""
    b = av.load_bundle(str(ROOT / "results" / "accuracy" / "vllm_prompts_stat.json.gz"))
    g = av.GRIDS["stat"]
    assert b["grid"] == g.as_dict() and b["meta"]["grid_name"] == "stat" and len(b["prompts"]) == g.prompts()
    assert len({p["prompt_sha256"] for p in b["prompts"]}) == len(b["prompts"])
    assert sum(p["variant"] == "single" for p in b["prompts"]) >= 1000
    assert sum(p["variant"] == "multi" for p in b["prompts"]) >= 500
    assert max(p["n_tokens"] for p in b["prompts"]) + g.max_new_tokens <= av.MAX_MODEL_LEN
    sets = {s["name"]: s for s in g.multi_sets()}
    for p in (b["prompts"][-1], next(p for p in b["prompts"] if p["needle_set"] == "vault-4"),
              next(p for p in b["prompts"] if p["variant"] == "single" and p["context_length"] == 8184)):
        s = sets.get(p["needle_set"])
        kw = dict(needles=s["needles"], key_names=s["key_names"], value_digits=s["value_digits"]) if s else {}
        q = build_prompt(tok, p["context_length"], p["depth"], p["key"], p["variant"], **kw)
        assert q.input_ids == p["input_ids"]


def test_bundle_with_multi_needle_sets(tok, stat_bundle):
    b = av.load_bundle(stat_bundle)
    single = [p for p in b["prompts"] if p["variant"] == "single"]
    multi = [p for p in b["prompts"] if p["variant"] == "multi"]
    assert len(single) == 24 * 16 == STAT_GRID.prompts() - len(multi) and len(multi) == 24
    assert {p["needle_set"] for p in single} == {"single"} and {p["needles"] for p in single} == {1}
    assert all(p["needle_set"] == "room-3" and p["key_names"] == ROOMS3 and p["needles"] == 3 and p["vault"] in ROOMS3
               and len(p["distractors"]) == 2 and p["value_digits"] == 5 for p in multi)
    p = multi[7]
    q = build_prompt(tok, p["context_length"], p["depth"], p["key"], "multi", needles=3, key_names=ROOMS3)
    assert q.input_ids == p["input_ids"] and q.sha256 == p["prompt_sha256"]
    assert [s["name"] for s in b["sanity"]][-2:] == ["passkey-256", "passkey-300"]
    joined = "".join(x["prompt_sha256"] for x in b["prompts"])
    assert b["meta"]["prompts_sha256"] == hashlib.sha256(joined.encode()).hexdigest()


def _script():
    return scripts_module.load("vllm_accuracy")


def test_build_bundle_command_and_its_errors(tok, tmp_path, monkeypatch, capsys):
    """build-bundle writes a named grid's bundle whole; a needle set that does not fit the shortest length fails
    before any prompt is built, naming needles, and writes nothing."""
    script = _script()
    tiny = av.VllmGrid(context_lengths=(300,), depths=(0.5,), num_keys=1, sanity_tokens=8,
                       multi=({"name": "room-2", "needles": 2, "key_names": ROOMS3[:2]},), sanity_lengths=(),
                       haystack="pd-books")
    big = av.VllmGrid(context_lengths=(128, 4096), depths=(0.5,), num_keys=1,
                      multi=({"name": "crowd", "needles": 26},))
    monkeypatch.setattr(av, "GRIDS", dict(av.GRIDS, tiny=tiny, crowd=big))
    out = tmp_path / "tiny.json.gz"
    assert script.main(["build-bundle", "--grid", "tiny", "--out", str(out)]) == 0
    b = av.load_bundle(str(out))
    assert [p["needle_set"] for p in b["prompts"]] == ["single", "room-2"] and b["meta"]["grid_name"] == "tiny"
    for p in b["prompts"]:   # the corpus haystack, as build_prompt builds it
        kw = dict(needles=2, key_names=ROOMS3[:2]) if p["variant"] == "multi" else {}
        q = build_prompt(tok, 300, 0.5, p["key"], p["variant"], haystack="pd-books", **kw)
        assert p["haystack"] == "pd-books" and q.input_ids == p["input_ids"]
    assert b["meta"]["model_sha256"] == av.file_sha256(os.path.join(*__import__("kvrepro.hf").hf.smollm2_gguf_path()))
    assert f"sha256 {av.file_sha256(str(out))}" in capsys.readouterr().out
    bad = tmp_path / "crowd.json.gz"
    with pytest.raises(ValueError, match=r"needle set 'crowd' at context length 128: needles: 26 needles with the "
                                         r"instruction and question take \d+ tokens, more than context_length=128"):
        script.main(["build-bundle", "--grid", "crowd", "--out", str(bad)])
    assert list(tmp_path.iterdir()) == [out]                      # nothing half-written
    with pytest.raises(SystemExit):
        script.main(["build-bundle", "--grid", "nope"])


def test_run_modes_on_several_gpus_and_without_key_logprobs(small_bundle, tmp_path, fake_env):
    """gpus=[0, 1]: one mode per GPU at a time (CUDA_VISIBLE_DEVICES of its worker), two modes overlapping;
    results in the order of modes. key_logprobs='none' skips the teacher-forced phase."""
    fake_env.setenv("FAKE_SLEEP_S", "2")
    fake_env.setenv("FAKE_TIMES", str(tmp_path))
    modes = ["bf16", "fp8", "kvrepro:k4v4"]
    res = av.run_modes(modes, small_bundle, small_bundle, str(tmp_path / "w"), factory=FACTORY, weights="dequant",
                       mode_timeout_s=90, deadline_s=240, gpus=[0, 0], key_logprobs="none")
    st = res["status"]      # one GPU given twice: two modes at once on it
    assert all(s["status"] == "ok" and s["gpu_index"] == 0 for s in st.values())
    (s1, e1), (s2, e2) = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("bf16", "fp8"))
    assert max(s1, s2) < min(e1, e2)
    res = av.run_modes(modes, small_bundle, small_bundle, str(tmp_path / "w"), factory=FACTORY, weights="dequant",
                       mode_timeout_s=90, deadline_s=240, gpus=[0, 1], key_logprobs="none")
    st = res["status"]
    assert list(st) == modes and all(s["status"] == "ok" for s in st.values())
    assert {st["bf16"]["gpu_index"], st["fp8"]["gpu_index"]} == {0, 1}
    assert all(s["info"]["cuda_visible_devices"] == str(s["gpu_index"]) for s in st.values())
    (s1, e1), (s2, e2) = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("bf16", "fp8"))
    assert max(s1, s2) < min(e1, e2)                                     # the first two ran at the same time
    assert [r["mode"] for r in res["rows"]] == sorted((r["mode"] for r in res["rows"]), key=modes.index)
    assert all(math.isnan(r["key_logprob_mean"]) for r in res["rows"]) and st["bf16"]["info"]["key_logprobs"] == "none"
    assert {r["bundle_sha256"] for r in res["rows"]} == {av.file_sha256(small_bundle)}
    with pytest.raises(ValueError, match="weights='auto' .* several gpus"):
        av.run_modes(modes, small_bundle, small_bundle, str(tmp_path / "w2"), factory=FACTORY, weights="auto",
                     gpus="0,1")
    for bad in ("a", [-1]):
        with pytest.raises(ValueError, match="gpus"):
            av.check_gpus(bad)
    assert av.check_gpus("0,0,1") == [0, 0, 1]         # two modes at once on GPU 0
    with pytest.raises(ValueError, match="key_logprobs"):
        av.run_modes(modes, small_bundle, small_bundle, str(tmp_path / "w3"), factory=FACTORY, key_logprobs="some")


def test_device_script_end_to_end_with_fake_engine(stat_bundle, tmp_path, fake_env):
    """The runner on a bundle large enough for a verdict: a faithful mode is NON-INFERIOR, one that loses 20
    prompts INFERIOR, one whose greedy continuations repeat FAILS, visibly: in stdout, in the rows' mode_verdict
    and in vllm_verdict.csv; every row names the bundle's SHA-256. Then one mode re-run and merged."""
    fake_env.setenv("FAKE_BUNDLE", stat_bundle)
    fake_env.setenv("FAKE_CORRUPT", "fp8")
    fake_env.setenv("FAKE_LOSE", "kvrepro:k4v2:20")
    out = tmp_path / "out"
    parts = tmp_path / "parts"
    parts.mkdir()
    blob = os.urandom(3000)
    (parts / "smollm2.gguf.part1").write_bytes(blob[:1000])
    (parts / "smollm2.gguf.part2").write_bytes(blob[1000:])
    cmd = [sys.executable, str(ROOT / "scripts" / "vllm_accuracy.py"), "--modes", "bf16,kvrepro:k4v4,kvrepro:k4v2,fp8",
           "--bundle", stat_bundle, "--gguf-parts", str(parts), "--out", str(out), "--factory", FACTORY,
           "--weights", "gguf", "--gpus", "0,1", "--key-logprobs", "none"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=os.environ)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[vllm-accuracy] status: bf16 ok" in r.stdout
    assert "[vllm-accuracy] verdict fp8: FAIL: output sanity (" in r.stdout
    assert (parts / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == blob
    assert sorted(p.name for p in out.iterdir()) == sorted(_script().OUTPUTS)
    df = pd.read_csv(out / "vllm_accuracy.csv", dtype={"key": str})
    meta = json.loads((out / "vllm_accuracy.json").read_text())
    v = pd.read_csv(out / "vllm_verdict.csv").set_index(["format", "variant"])
    assert set(df["mode"]) == {"bf16", "fp8", "kvrepro:k4v4", "kvrepro:k4v2"} and meta["measured"]
    assert meta["status"]["fp8"]["status"] == "ok" and meta["bundle_sha256"] == av.file_sha256(stat_bundle)
    assert (df["bundle_sha256"] == av.file_sha256(stat_bundle)).all()
    assert v.loc[("k4v4", "single"), "verdict"] == "NON-INFERIOR" and v.loc[("k4v4", "single"), "pairs"] == 384
    assert v.loc[("k4v4", "multi"), "verdict"] == "NOT JUDGED"            # 24 pairs
    assert (v.loc[("k4v2", "single"), "lost"], v.loc[("k4v2", "single"), "verdict"]) == (20, "INFERIOR")
    assert v.loc[("fp8", "overall"), "verdict"] == "FAIL" and v.loc[("fp8", "single"), "retrieval"] == "NON-INFERIOR"
    verdict_of = df.groupby("mode")["mode_verdict"].unique()
    assert {m: list(x) for m, x in verdict_of.items()} == {
        "bf16": ["baseline"], "fp8": ["FAIL"], "kvrepro:k4v2": ["INFERIOR"], "kvrepro:k4v4": ["NON-INFERIOR"]}
    assert v.loc[("fp8", "overall"), "text"].startswith("FAIL: output sanity (")
    bound = v.loc[("k4v2", "single"), "bound_pp"]
    assert v.loc[("k4v2", "overall"), "text"] == (f"INFERIOR (single: bound {bound:.2f} pp > 1 pp; multi: NOT JUDGED, "
                                                  "24 pairs < 368 needed for a 1 pp margin)")
    assert meta["summary"]["verdict"]["k4v4/overall"]["verdict"] == "NON-INFERIOR"
    assert set(df["needle_set"]) == {"single", "room-3"} and set(df[df["variant"] == "multi"]["key_names"]) == \
        {" | ".join(ROOMS3)}
    for col in ("gpu", "vllm_version", "torch_version", "date", "prompt_sha256", "engine", "weights"):
        assert col in df.columns
    assert df["prompt_sha256"].map(len).eq(64).all()
    assert ids_sha256([1, 2]) != ids_sha256([2, 1])
    fake_env.delenv("FAKE_CORRUPT")
    # re-running one mode into a new folder, merged with the first: bf16 kept, fp8 replaced, k4v4 added
    out2 = tmp_path / "out2"
    cmd2 = cmd[:cmd.index("--modes") + 1] + ["fp8"] + cmd[cmd.index("--modes") + 2:]
    cmd2[cmd2.index("--out") + 1] = str(out2)
    r = subprocess.run(cmd2 + ["--merge-from", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT,
                       env=os.environ)
    assert r.returncode == 0, r.stdout + r.stderr
    df2 = pd.read_csv(out2 / "vllm_accuracy.csv", dtype={"key": str})
    meta2 = json.loads((out2 / "vllm_accuracy.json").read_text())
    n = len(df) // 4
    assert df2.groupby("mode").size().to_dict() == {m: n for m in ("bf16", "fp8", "kvrepro:k4v4", "kvrepro:k4v2")}
    cols = [c for c in df.columns if c != "mode_verdict"]
    pd.testing.assert_frame_equal(df2[df2["mode"] == "bf16"][cols].reset_index(drop=True),
                                  df[df["mode"] == "bf16"][cols].reset_index(drop=True), check_dtype=False)
    assert meta2["status"]["bf16"]["merged_from"] == meta["started_utc"] and "merged_from" not in meta2["status"]["fp8"]
    assert meta2["merged_from"]["modes"] == ["bf16", "kvrepro:k4v2", "kvrepro:k4v4"]
    assert meta2["summary"]["verdict"]["fp8/overall"]["verdict"] == "NON-INFERIOR"   # re-run without the corruption
    assert set(df2[df2["mode"] == "fp8"]["mode_verdict"]) == {"NON-INFERIOR"}
    assert set(pd.read_csv(out2 / "vllm_sanity.csv")["mode"]) == {"bf16", "fp8", "kvrepro:k4v4", "kvrepro:k4v2"}
    # a folder of another prompt bundle is refused, naming the option
    df.assign(prompt_sha256="0" * 64).to_csv(out / "vllm_accuracy.csv", index=False)
    with pytest.raises(ValueError, match="--merge-from .* not in this bundle"):
        _script().load_previous(str(out), av.load_bundle(stat_bundle), ("fp8",))


def test_the_replica_grid_shares_no_prompt_with_the_stat_grid():
    """The replication must be judged on its own prompts: its keys (seed 1) and the stat grid's (seed 0) are disjoint
    and it has at least twice the single-needle prompts; the committed replica bundle matches its grid."""
    from kvrepro.needle import make_keys

    stat, rep = av.GRIDS["stat"], av.GRIDS["stat-replica"]
    assert not set(make_keys(stat.num_keys, stat.seed)) & set(make_keys(rep.num_keys, rep.seed))
    assert rep.variants == ("single",) and rep.prompts() == 2 * len(stat.context_lengths) * len(stat.depths) * 12
    path = os.path.join(ROOT, "results", "accuracy", "vllm_prompts_replica.json.gz")
    b = av.load_bundle(path)
    assert b["meta"]["grid_name"] == "stat-replica" and len(b["prompts"]) == rep.prompts() == 2112
    assert not {p["prompt_sha256"] for p in b["prompts"]} & \
        {p["prompt_sha256"] for p in av.load_bundle(os.path.join(ROOT, "results", "accuracy", "vllm_prompts_stat.json.gz"))["prompts"]}
