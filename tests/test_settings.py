"""kvrepro.settings: every KVREPRO_* runtime variable declared once, read with one set of rules (case and surrounding
spaces ignored, empty = unset), refused with the variable and the allowed values."""
import dataclasses
import subprocess
import sys

import pytest

from kvrepro import settings as st
from kvrepro.settings import Settings


def test_defaults_and_declarations():
    s = Settings.from_env({})
    assert s == Settings() and s.as_dict() == {"preset": "k5v4", "decode_impl": "auto", "num_splits": None,
                                               "prefill": "fa", "store_rotate": "kernel",
                                               "key_offset": "rope-mean", "warmup": True, "debug_check": False}
    assert [d.field for d in st.SETTINGS] == list(s.as_dict())
    assert [d.env for d in st.SETTINGS] == ["KVREPRO_PRESET", "KVREPRO_DECODE_IMPL", "KVREPRO_NUM_SPLITS",
                                            "KVREPRO_PREFILL", "KVREPRO_STORE_ROTATE", "KVREPRO_KEY_OFFSET", "KVREPRO_WARMUP",
                                            "KVREPRO_DEBUG_CHECK"]
    assert s.describe() == ("kvrepro settings: preset=k5v4 decode_impl=auto num_splits=auto prefill=fa "
                            "store_rotate=kernel key_offset=rope-mean warmup=1 debug_check=0")
    assert s.decode_impl_arg is None and Settings(decode_impl="cuda").decode_impl_arg == "cuda"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.preset = "k8v4"
    # the log line reads back (kvrepro.servebench reads a server's settings from its log this way)
    k = Settings(preset="k4v4", key_offset="slow-pairs", num_splits=7)
    log = f"INFO boot\n(EngineCore pid=1) INFO [config.py:73] {k.describe()}\nINFO later {s.describe()}\n"
    assert st.described_in(log) == {"preset": "k4v4", "decode_impl": "auto", "num_splits": "7", "prefill": "fa",
                                    "store_rotate": "kernel", "key_offset": "slow-pairs", "warmup": "1",
                                    "debug_check": "0"}
    assert st.described_in("INFO an fp8 engine logs no settings line\n") is None


def test_key_offset(monkeypatch):
    from kvrepro.formats import DEFAULT_PRESET, get_format
    from kvrepro.formats.offset import MODES

    assert st.KEY_OFFSET_MODES == MODES
    assert st.KEY_OFFSET_DEFAULT == get_format(DEFAULT_PRESET).default_key_offset == Settings().key_offset
    monkeypatch.setenv("KVREPRO_KEY_OFFSET", " OFF ")
    assert Settings.from_env().key_offset == "off"
    monkeypatch.setenv("KVREPRO_KEY_OFFSET", "mean")
    with pytest.raises(ValueError, match="KVREPRO_KEY_OFFSET='mean'; allowed: slow-pairs, first-prefill, off"):
        Settings.from_env()


def test_presets_are_the_compressed_formats():
    from kvrepro.formats import COMPRESSED_PRESETS, DEFAULT_PRESET

    assert st.PRESETS == tuple(COMPRESSED_PRESETS) and st.DEFAULT_PRESET == DEFAULT_PRESET


def test_preset(monkeypatch):
    monkeypatch.delenv("KVREPRO_PRESET", raising=False)
    assert Settings.from_env().preset == "k5v4"
    monkeypatch.setenv("KVREPRO_PRESET", " K8V4 ")
    assert Settings.from_env().preset == "k8v4"
    monkeypatch.setenv("KVREPRO_PRESET", "")                     # empty = unset
    assert Settings.from_env().preset == "k5v4"
    monkeypatch.setenv("KVREPRO_PRESET", "int3")
    with pytest.raises(ValueError, match="KVREPRO_PRESET='int3' is not a kvrepro compressed preset; allowed: "
                                         "k4v4, k8v4, k4v2"):
        Settings.from_env()
    assert st.parse("preset", "k4v2") == "k4v2"
    with pytest.raises(ValueError, match=r"KVREPRO_PRESET must be a preset name \(str\), got 4; allowed: k4v4"):
        st.parse("preset", 4)
    with pytest.raises(ValueError, match="unknown kvrepro setting 'presets'; allowed: preset, decode_impl"):
        st.parse("presets", "k4v4")


def test_prefill_path_and_decode_impl():
    assert Settings.from_env({"KVREPRO_PREFILL": "fa-sliced"}).prefill == "fa-sliced"
    with pytest.raises(ValueError, match="KVREPRO_PREFILL='sdpa'; allowed: fa, fa-sliced, fa-pages, dequant, triton"):
        Settings.from_env({"KVREPRO_PREFILL": "sdpa"})
    assert Settings.from_env({"KVREPRO_DECODE_IMPL": " CUDA "}).decode_impl == "cuda"
    with pytest.raises(ValueError) as e:                       # every bad variable at once, not only the first
        Settings.from_env({"KVREPRO_PRESET": "k9v9", "KVREPRO_KEY_OFFSET": "bogus"})
    assert "KVREPRO_PRESET='k9v9'" in str(e.value) and "KVREPRO_KEY_OFFSET='bogus'; allowed: slow-pairs" in str(e.value)
    assert Settings(decode_impl="triton").decode_impl == "triton"
    with pytest.raises(ValueError, match="KVREPRO_DECODE_IMPL='fast'; allowed: auto, cuda, triton"):
        Settings(decode_impl="fast")


def test_num_splits():
    assert Settings.from_env({"KVREPRO_NUM_SPLITS": ""}).num_splits is None
    assert Settings.from_env({"KVREPRO_NUM_SPLITS": " 8 "}).num_splits == 8 and Settings(num_splits=16).num_splits == 16
    for bad in ("0", "x", "1000", "-1", "²"):
        with pytest.raises(ValueError, match="KVREPRO_NUM_SPLITS must be an integer in 1..256"):
            Settings.from_env({"KVREPRO_NUM_SPLITS": bad})
    with pytest.raises(ValueError, match="KVREPRO_NUM_SPLITS"):
        Settings(num_splits=True)


def test_switches_and_store_rotate_ignore_case_and_spaces():
    """The 0/1 switches ignore surrounding spaces, KVREPRO_STORE_ROTATE case and spaces, like every setting;
    anything else is refused with the variable and the allowed values."""
    s = Settings.from_env({"KVREPRO_WARMUP": " 0 ", "KVREPRO_DEBUG_CHECK": "1", "KVREPRO_STORE_ROTATE": " Torch "})
    assert (s.warmup, s.debug_check, s.store_rotate) == (False, True, "torch")
    for env, bad, msg in (("KVREPRO_WARMUP", " on ", "KVREPRO_WARMUP='on'; allowed: 0, 1"),
                          ("KVREPRO_WARMUP", "yes", "KVREPRO_WARMUP='yes'; allowed: 0, 1"),
                          ("KVREPRO_DEBUG_CHECK", "true", "KVREPRO_DEBUG_CHECK='true'; allowed: 0, 1"),
                          ("KVREPRO_STORE_ROTATE", "numpy", "KVREPRO_STORE_ROTATE='numpy'; allowed: kernel, torch")):
        with pytest.raises(ValueError, match=msg):
            Settings.from_env({env: bad})


def test_as_env_round_trips_and_unknown_variables():
    s = Settings(preset="k4v2", decode_impl="triton", num_splits=4, prefill="dequant", store_rotate="torch",
                 warmup=False, debug_check=True)
    assert Settings.from_env(s.as_env()) == s
    assert "KVREPRO_NUM_SPLITS" not in Settings().as_env() and Settings.from_env(Settings().as_env()) == Settings()
    env = {"KVREPRO_PRESET": "k4v4", "KVREPRO_KEY_CENTER": "first-prefill", "KVREPRO_RECENT_WINDOW": "32",
           "KVREPRO_SMOKE_FLAGS": "/tmp/x", "OTHER": "1"}
    assert st.unknown_variables(env) == ["KVREPRO_KEY_CENTER", "KVREPRO_RECENT_WINDOW"]


def test_settings_table_is_one_row_per_variable():
    rows = st.settings_table()
    assert [r["variable"] for r in rows] == [d.env for d in st.SETTINGS]
    assert all(set(r) == {"variable", "values", "default", "changes", "effect"} and r["changes"] and r["effect"]
               for r in rows)
    assert rows[0] == {"variable": "KVREPRO_PRESET", "values": "k4v4, k8v4, k4v2, k5v4", "default": "k5v4",
                       "changes": st.SETTINGS[0].doc, "effect": st.SETTINGS[0].effect}
    assert {r["variable"]: r["default"] for r in rows}["KVREPRO_NUM_SPLITS"] == "unset"
    md = st.markdown_table().splitlines()
    assert md[0] == "| variable | values | default | what it changes | measured effect |"
    assert len(md) == 2 + len(rows) and all(line.count(" | ") == 4 for line in md[2:])


def test_measured_effects_link_committed_files_or_say_not_measured():
    """Each setting's measured effect links result files or notes that exist (a notes link's #anchor is one of the
    note's headings, as GitHub makes anchors), or starts with "not measured"."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]

    def anchors(md: pathlib.Path) -> set[str]:
        heads = [ln.lstrip("#").strip() for ln in md.read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
        return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in heads}

    for d in st.SETTINGS:
        links = re.findall(r"\]\(([^)]+)\)", d.effect)
        assert links or d.effect.startswith("not measured"), d.env
        if not d.effect.startswith("not measured"):
            assert links, d.env
        for link in links:
            path, _, anchor = link.partition("#")
            assert (root / path).is_file(), (d.env, link)
            if anchor:
                assert anchor in anchors(root / path), (d.env, link)
    assert st.BY_FIELD["debug_check"].effect.startswith("not measured")


def test_imports_without_torch_and_prints_the_table():
    code = ("import sys, kvrepro.settings as s; assert not [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'vllm')]; s._main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"KVREPRO_PRESET": "k8v4", "KVREPRO_KEY_CENTER": "off", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "| `KVREPRO_PRESET` |" in r.stdout and "kvrepro settings: preset=k8v4" in r.stdout
    assert "unknown KVREPRO_ variables (ignored): KVREPRO_KEY_CENTER" in r.stderr    # a warning: not in the table
    assert "KVREPRO_KEY_CENTER" not in r.stdout


def test_combinations_the_engine_refuses_are_named_by_the_settings_check(monkeypatch):
    """rope-mean with the dequant prefill, and the CUDA decode kernel with a preset it has no variant of, are reported
    by Settings.conflicts (naming both variables and what to use) and make `python -m kvrepro.settings` exit 1."""
    from kvrepro.ops import cuda_decode

    assert set(st.CUDA_PRESETS) == set(cuda_decode.PRESETS.values())
    c = Settings.from_env({"KVREPRO_PREFILL": "dequant"}).conflicts()         # the default key offset is rope-mean
    assert len(c) == 1 and c[0].startswith("KVREPRO_KEY_OFFSET=rope-mean (the default) cannot run with "
                                           "KVREPRO_PREFILL=dequant")
    assert "fa, fa-sliced, fa-pages, triton" in c[0] and "or KVREPRO_KEY_OFFSET=slow-pairs" in c[0]
    assert Settings.from_env({"KVREPRO_PREFILL": "dequant", "KVREPRO_KEY_OFFSET": "slow-pairs"}).conflicts() == []
    for preset in st.PRESETS:                             # every preset has a CUDA kernel
        assert Settings.from_env({"KVREPRO_DECODE_IMPL": "cuda", "KVREPRO_PRESET": preset}).conflicts() == []
    monkeypatch.setattr(st, "CUDA_PRESETS", ("k4v4", "k8v4", "k4v2"))   # a preset without one is named
    c = Settings.from_env({"KVREPRO_DECODE_IMPL": "cuda", "KVREPRO_PRESET": "k5v4"}).conflicts()
    assert c == ["KVREPRO_DECODE_IMPL=cuda: the CUDA decode kernel has no k5v4 variant (it has k4v4, k8v4, k4v2); use "
                 "KVREPRO_DECODE_IMPL=auto or triton, or another KVREPRO_PRESET"]
    monkeypatch.undo()
    from kvrepro.ops import prefill
    assert st.ROPE_GPU_PRESETS == prefill.ROPE_GPU_PRESETS
    for preset in ("k8v4", "k4v2"):                       # rope-mean's Triton prefill faults on the GPU for these
        c = Settings.from_env({"KVREPRO_PREFILL": "triton", "KVREPRO_PRESET": preset}).conflicts()
        assert c == [f"KVREPRO_KEY_OFFSET=rope-mean with KVREPRO_PREFILL=triton: the Triton prefill kernel's correction "
                     f"faults on the GPU for KVREPRO_PRESET={preset} (it runs for k4v4, k5v4: notes/kernels.md, Known "
                     "limits); use KVREPRO_PREFILL= one of fa, fa-sliced, fa-pages, or KVREPRO_PRESET= one of k4v4, k5v4"]
        assert Settings.from_env({"KVREPRO_PREFILL": "triton", "KVREPRO_PRESET": preset,
                                  "KVREPRO_KEY_OFFSET": "slow-pairs"}).conflicts() == []
    for preset in ("k4v4", "k5v4"):
        assert Settings.from_env({"KVREPRO_PREFILL": "triton", "KVREPRO_PRESET": preset}).conflicts() == []
    assert Settings().conflicts() == []
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVREPRO_")}
    r = subprocess.run([sys.executable, "-m", "kvrepro.settings"], capture_output=True, text=True, timeout=120,
                       env=dict(env, KVREPRO_PREFILL="dequant"))
    assert r.returncode == 1 and "cannot run with KVREPRO_PREFILL=dequant" in r.stderr
    for bad in (["--bogus"], ["extra"]):                                # the command takes no arguments
        r = subprocess.run([sys.executable, "-m", "kvrepro.settings", *bad], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr
