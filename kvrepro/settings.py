"""Every ``KVREPRO_*`` runtime variable, declared once: type, default, allowed values, what it changes.

As vLLM's ``vllm/envs.py``: :data:`SETTINGS` declares each variable once; :class:`Settings` is the one resolved
object, read from the environment by :meth:`Settings.from_env`. The vLLM backend resolves it once per engine
(``kvrepro.vllm_backend.config.settings_for_engine``), logs it at engine start (``kvrepro settings: preset=k4v4
decode_impl=auto ...``), hands the same object to every layer, and the capacity sweep and the vLLM accuracy runs
store it in every result row (``kvrepro_settings``). :func:`settings_table` gives the declarations as table rows
(variable, values, default, what it changes, its measured effect), e.g. for the README; ``python -m kvrepro.settings`` prints them and
the values resolved from this shell.

Reading rules, the same for every variable: case and surrounding spaces are ignored; an empty variable counts as
unset (its default). A bad value raises ``ValueError`` naming the variable and the allowed values.

Pure Python: imports neither torch nor vLLM (the preset names are checked against ``kvrepro.formats`` by the tests).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

PREFIX = "KVREPRO_"
LOG_PREFIX = "kvrepro settings: "     # Settings.describe's line; read back by described_in
PRESETS = ("k4v4", "k8v4", "k4v2", "k5v4")  # = kvrepro.formats.COMPRESSED_PRESETS
DEFAULT_PRESET = "k5v4"                     # = kvrepro.formats.DEFAULT_PRESET
DECODE_IMPLS = ("auto", "cuda", "triton")
PREFILL_PATHS = ("fa", "fa-sliced", "fa-pages", "dequant", "triton")
CUDA_PRESETS = ("k4v4", "k8v4", "k4v2", "k5v4")   # the CUDA decode kernel's variants (= kvrepro.ops.cuda_decode.PRESETS)
ROPE_GPU_PRESETS = ("k4v4", "k5v4")        # = kvrepro.ops.prefill.ROPE_GPU_PRESETS: rope-mean's Triton prefill on a GPU
STORE_ROTATE_MODES = ("kernel", "torch")
KEY_OFFSET_MODES = ("slow-pairs", "first-prefill", "off", "rope-mean")   # = kvrepro.formats.offset.MODES
KEY_OFFSET_DEFAULT = "rope-mean"        # = kvrepro.formats.compressed.CompressedFormat.default_key_offset
MAX_NUM_SPLITS = 256
# KVREPRO_* variables that are not runtime settings (read by the test harness only), so not reported as unknown.
NOT_SETTINGS = ("KVREPRO_SMOKE_FLAGS",)


def _text(env: str, value: Any, what: str, allowed: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{env} must be {what} (str), got {value!r}; allowed: {allowed}")
    return value.strip().lower()


def _choice(env: str, allowed: tuple[str, ...], what: str = "one of the allowed values"):
    def parse(value: Any) -> str:
        v = _text(env, value, what, ", ".join(allowed))
        if v not in allowed:
            raise ValueError(f"{env}={v!r}; allowed: {', '.join(allowed)}")
        return v
    return parse


def _preset(value: Any) -> str:
    v = _text("KVREPRO_PRESET", value, "a preset name", ", ".join(PRESETS))
    if v not in PRESETS:
        raise ValueError(f"KVREPRO_PRESET={v!r} is not a kvrepro compressed preset; allowed: {', '.join(PRESETS)}")
    return v


def _num_splits(value: Any) -> int | None:
    """None (the shape rule), an int (not a bool) or a string of ASCII digits, in 1..MAX_NUM_SPLITS."""
    if value is None:
        return None
    n = None
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        n = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    if n is None or not 1 <= n <= MAX_NUM_SPLITS:
        raise ValueError(f"KVREPRO_NUM_SPLITS must be an integer in 1..{MAX_NUM_SPLITS}, got {value!r}")
    return n


def _switch(env: str):
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):      # Settings(warmup=1), as the variable's text says
            return value == 1
        v = value.strip() if isinstance(value, str) else value
        if v not in ("0", "1"):
            raise ValueError(f"{env}={v!r}; allowed: 0, 1")
        return v == "1"
    return parse


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One runtime variable.

    Attributes:
        field: the :class:`Settings` attribute.
        env: the environment variable (``KVREPRO_...``).
        values: the allowed values, as a table shows them.
        default: the default, as the environment would spell it (``""``: unset = the rule described in ``doc``).
        doc: what it changes, and why the default is the default.
        parse: a value (environment text, or the attribute's own type) -> the attribute's value; raises ValueError
            naming ``env`` and the allowed values.
        effect: what a committed measurement says the setting changes, as Markdown linking the result files or
            notes that hold it (paths from the repository root), or ``"not measured"`` and why.
    """

    field: str
    env: str
    values: str
    default: str
    doc: str
    parse: Callable[[Any], Any]
    effect: str = "not measured"

    def read(self, environ: Mapping[str, str]) -> Any:
        """The value ``environ`` gives this variable (unset, empty or only spaces: the default)."""
        raw = environ.get(self.env)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return self.parse(self.default) if self.default else None
        return self.parse(raw)


SETTINGS: tuple[Declaration, ...] = (
    Declaration(
        "preset", "KVREPRO_PRESET", ", ".join(PRESETS), DEFAULT_PRESET,
        "The compressed KV format of every layer (bits per key / value element; kvrepro.formats). k5v4, the default: "
        "5-bit symmetric keys, 4-bit values with a one-byte log2 scale, 147 B per token and KV head at head_dim 128, "
        "the preset that meets fp8's fidelity at 12 users of the seed workload, its own CUDA decode kernel (README, "
        "results); k4v4: 134 B, 13 users, faster per user, a larger fidelity cost (README, fidelity). "
        "vLLM runs with kv_cache_dtype='auto' and --attention-backend CUSTOM: the compression is the KV dtype.",
        _preset,
        "users and decode tok/s per preset at 128K on an 80 GiB budget (H200): capacity rows with the default key "
        "offset for k5v4, k4v4 and k4v2 (with fp8 on FA3 and on FlashInfer, one run: [h200-20261204-r3.jsonl]"
        "(results/capacity/h200-20261204-r3.jsonl)), and [earlier rows](results/capacity/h200-20261201-w13.jsonl) "
        "(k8v4); KL and perplexity vs bf16: [fidelity rows](results/fidelity/"
        "reference_cpu_smollm2.csv); needle retrieval through vLLM: [accuracy rows](results/accuracy/vllm_h200_replica/"
        "vllm_accuracy.csv.gz) (the README's results and fidelity tables)"),
    Declaration(
        "decode_impl", "KVREPRO_DECODE_IMPL", ", ".join(DECODE_IMPLS), "auto",
        "Decode kernel. cuda: kvrepro's CUDA kernels (every preset; head_dim 128, block 16, GQA group <= 8, "
        "compute capability >= 8.0; anything else is refused at engine start); triton: every preset and shape; "
        "auto: cuda where it applies, else triton (kvrepro.ops.decode.resolve_impl).",
        _choice("KVREPRO_DECODE_IMPL", DECODE_IMPLS),
        "decode time of the CUDA and Triton kernels at 128K (H200): batch 1 / 3 / 6 / 13, k4v4, k8v4, k4v2: "
        "[decode_side_by_side.json](benchmarks/results/decode_side_by_side.json); batch 3 / 6 / 13, every preset, "
        "with and without the rope-mean correction: [decode_rope_mean.json](benchmarks/results/decode_rope_mean.json)"),
    Declaration(
        "num_splits", "KVREPRO_NUM_SPLITS", f"1..{MAX_NUM_SPLITS}", "",
        "Split-K count of every decode launch. Unset: the decode kernel's shape-only rule "
        "(runtime.decode_splits), which keeps the grid fixed per CUDA-graph batch size.",
        _num_splits,
        "decode time per split count (H200, k4v2 at 128K): [decode_splits.json](benchmarks/results/decode_splits.json); "
        "under an A100's and an Ada GPU's shared-memory budget, emulated on the H200 by the carveout: "
        "[carveout_splits_h200.json](results/reach/carveout_splits_h200.json) (README, Supported GPUs and models)"),
    Declaration(
        "prefill", "KVREPRO_PREFILL", ", ".join(PREFILL_PATHS), "fa",
        "Prefill path. fa: dequantize the context, then vLLM's FlashAttention (measured, the default); fa-sliced: "
        "the same slice by slice with a log-sum-exp merge (bounded temporaries); fa-pages: as fa, but the chunk's "
        "own K/V are also read back from the pages, so every prompt position attends to the compressed KV as decode "
        "does (for fidelity measurement: kvrepro.fidelity); dequant: the context dequantized "
        "in the rotated space by a Triton kernel, one FlashAttention call (fa_prefill.RotatedDequantPrefill); "
        "triton: kvrepro's direct-read prefill kernel (correct, but ~3x bf16 at 128K: notes/kernels.md, Prefill; "
        "with the key offset rope-mean on a GPU only for k4v4 and k5v4: notes/kernels.md, Known limits).",
        _choice("KVREPRO_PREFILL", PREFILL_PATHS),
        "prefill time of the paths at 128K (H200): [notes/kernels.md, Prefill](notes/kernels.md#prefill), run folders "
        "at commit 0718ce1 (tag lab-notebook-2026-12-01); each capacity row records the path that ran "
        "([capacity rows](results/capacity/h200-20261201-w13.jsonl))"),
    Declaration(
        "store_rotate", "KVREPRO_STORE_ROTATE", ", ".join(STORE_ROTATE_MODES), "kernel",
        "Where new K/V are rotated before quantization. kernel: inside the Triton store kernel, by the +-1 Hadamard "
        "matrix on the tensor cores (exact products, float32 sums), with no register-spill stack; it needs kvrepro's "
        "own rotation (any other is refused at the first store, naming torch); torch: x.float() @ R in PyTorch, then "
        "the quantize kernel (two casts and two float32 GEMMs more per layer and step; any rotation).",
        _choice("KVREPRO_STORE_ROTATE", STORE_ROTATE_MODES),
        "time of one layer's store with each, every preset (H200): [store_rotate.json](benchmarks/results/"
        "store_rotate.json); a decode step with each: [notes/vllm.md, Inside a decode step](notes/vllm.md"
        "#inside-a-decode-step-and-under-serving-load-issue-23); the KV capacity an earlier, spilling in-kernel "
        "rotation cost: [notes/vllm.md, Memory accounting](notes/vllm.md#memory-accounting-what-was-learned)"),
    Declaration(
        "key_offset", "KVREPRO_KEY_OFFSET", ", ".join(KEY_OFFSET_MODES), KEY_OFFSET_DEFAULT,
        "How keys are stored (kvrepro.formats.offset); attention sees the exact keys in every mode. rope-mean: keys "
        "minus R(p) b_hat, the first prefill's pre-RoPE mean turned to each key's position, in up to 8 RoPE pairs "
        "per layer and KV head, added back to the scores by the decode kernels (CUDA and Triton) and the prefill; "
        "robust to a key-projection bias added before RoPE in any pair; costs decode time (a correction per paged key); "
        "KVREPRO_PREFILL may not be dequant. slow-pairs: a constant per layer and KV head, the first prefill's mean "
        "only in the RoPE pairs that turn by < pi/4 over max_model_len (no decode cost, not robust to a bias in the "
        "faster pairs); first-prefill: that constant in every channel; off: keys stored as they are "
        "(notes/accuracy.md, 'Key offset'). rope-mean is the default because it is the one mode that keeps every "
        "preset within 1.5x of its unbiased attention error under a key bias, with the lowest KL on both engines; "
        "slow-pairs is the choice where decode speed matters more than a bias.",
        _choice("KVREPRO_KEY_OFFSET", KEY_OFFSET_MODES),
        "attention-output error under a key bias: [rope-mean](results/keybias/keybias_rope_mean_cpu.csv), "
        "[the others](results/keybias/keybias_cpu.csv); KL per mode: [CPU reference rows](results/fidelity/"
        "reference_cpu_smollm2.csv) and [vLLM rows](results/fidelity/vllm_h200_smollm2.csv) (rope-mean and "
        "slow-pairs); decode time of the correction: [decode_rope_mean.json](benchmarks/results/decode_rope_mean.json);"
        " 128K capacity with rope-mean: [h200-20261204-r3.jsonl](results/capacity/h200-20261204-r3.jsonl) (k5v4,"
        " k4v4 and k4v2 on the CUDA kernel, with fp8 on FA3 and on FlashInfer)"),
    Declaration(
        "warmup", "KVREPRO_WARMUP", "0, 1", "1",
        "1: compile and load every decode-kernel variant before vLLM's memory profiling, so that no compilation "
        "or module load falls inside its CUDA-graph memory estimate; 0: compile on first use.",
        _switch("KVREPRO_WARMUP"),
        "not measured (why it exists: [notes/vllm.md, Memory accounting](notes/vllm.md#memory-accounting-what-was-learned))"),
    Declaration(
        "debug_check", "KVREPRO_DEBUG_CHECK", "0, 1", "0",
        "Debug only (slow, host syncs): 1 compares every eagerly run attention call with attention over the "
        "dequantized pages (runtime.reference_attend) and records the error in runtime.CHECKS.",
        _switch("KVREPRO_DEBUG_CHECK"),
        "not measured (debug only)"),
)
BY_FIELD: dict[str, Declaration] = {d.field: d for d in SETTINGS}
BY_ENV: dict[str, Declaration] = {d.env: d for d in SETTINGS}


def parse(field: str, value: Any) -> Any:
    """``value`` of the setting ``field`` (a :class:`Settings` attribute name), validated and normalized.

    Raises:
        ValueError: unknown ``field`` (lists the fields), or a bad value (names the variable and the allowed values).
    """
    if field not in BY_FIELD:
        raise ValueError(f"unknown kvrepro setting {field!r}; allowed: {', '.join(BY_FIELD)}")
    return BY_FIELD[field].parse(value)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved ``KVREPRO_*`` settings (one object per engine). Field values are validated and normalized on
    construction (``Settings(preset=" K8V4 ")`` has ``preset == "k8v4"``); see :data:`SETTINGS` for each.

    Attributes:
        preset: ``"k4v4"`` | ``"k8v4"`` | ``"k4v2"`` | ``"k5v4"``.
        decode_impl: ``"auto"`` | ``"cuda"`` | ``"triton"``.
        num_splits: int in 1..256, or None (the decode kernel's shape-only rule).
        prefill: ``"fa"`` | ``"fa-sliced"`` | ``"fa-pages"`` | ``"dequant"`` | ``"triton"``.
        store_rotate: ``"kernel"`` | ``"torch"``.
        key_offset: ``"slow-pairs"`` | ``"first-prefill"`` | ``"off"`` | ``"rope-mean"``.
        warmup: compile the decode kernels before vLLM's memory profiling.
        debug_check: compare every eager attention call with the reference (slow).

    Raises:
        ValueError: a bad value, naming the variable and the allowed values.
    """

    preset: str = DEFAULT_PRESET
    decode_impl: str = "auto"
    num_splits: int | None = None
    prefill: str = "fa"
    store_rotate: str = "kernel"
    key_offset: str = KEY_OFFSET_DEFAULT
    warmup: bool = True
    debug_check: bool = False

    def __post_init__(self) -> None:
        for d in SETTINGS:
            object.__setattr__(self, d.field, d.parse(getattr(self, d.field)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings ``environ`` (default ``os.environ``) gives; unset or empty variables take their defaults.

        Raises:
            ValueError: every bad value at once ("; "-joined), each naming its variable and the allowed values.
        """
        environ = os.environ if environ is None else environ
        values, bad = {}, []
        for d in SETTINGS:
            try:
                values[d.field] = d.read(environ)
            except ValueError as e:
                bad.append(str(e))
        if bad:
            raise ValueError("; ".join(bad))
        return cls(**values)

    def conflicts(self) -> list[str]:
        """Combinations of valid values that the engine refuses at start (the runtime, the backend's start on a GPU
        and ``kvrepro.vllm_backend.config.serving_plan`` say so there too), one sentence each naming both variables and
        what to use instead; [] when there is none. ``python -m kvrepro.settings`` exits 1 on any."""
        out = []
        if self.key_offset == "rope-mean" and self.prefill == "dequant":
            others = ", ".join(p for p in PREFILL_PATHS if p != "dequant")
            default = " (the default)" if self.key_offset == KEY_OFFSET_DEFAULT else ""
            out.append(f"KVREPRO_KEY_OFFSET=rope-mean{default} cannot run with KVREPRO_PREFILL=dequant (that prefill "
                       f"reads the pages' keys without the per-position offset); use KVREPRO_PREFILL= one of {others}, "
                       "or KVREPRO_KEY_OFFSET=slow-pairs to keep the dequant prefill")
        if self.key_offset == "rope-mean" and self.prefill == "triton" and self.preset not in ROPE_GPU_PRESETS:
            fa = ", ".join(p for p in PREFILL_PATHS if p.startswith("fa"))
            out.append(f"KVREPRO_KEY_OFFSET=rope-mean with KVREPRO_PREFILL=triton: the Triton prefill kernel's "
                       f"correction faults on the GPU for KVREPRO_PRESET={self.preset} (it runs for "
                       f"{', '.join(ROPE_GPU_PRESETS)}: notes/kernels.md, Known limits); use KVREPRO_PREFILL= one of "
                       f"{fa}, or KVREPRO_PRESET= one of {', '.join(ROPE_GPU_PRESETS)}")
        if self.decode_impl == "cuda" and self.preset not in CUDA_PRESETS:
            out.append(f"KVREPRO_DECODE_IMPL=cuda: the CUDA decode kernel has no {self.preset} variant (it has "
                       f"{', '.join(CUDA_PRESETS)}); use KVREPRO_DECODE_IMPL=auto or triton, or another KVREPRO_PRESET")
        return out

    def as_dict(self) -> dict[str, Any]:
        """``{field: value}`` (JSON-serializable), in declaration order."""
        return {d.field: getattr(self, d.field) for d in SETTINGS}

    def as_env(self) -> dict[str, str]:
        """The environment that gives these settings (``{variable: text}``; an unset ``num_splits`` is left out)."""
        out = {}
        for d in SETTINGS:
            v = getattr(self, d.field)
            if v is None:
                continue
            out[d.env] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    @property
    def decode_impl_arg(self) -> str | None:
        """``decode_impl`` as ``kvrepro.ops.decode_attention`` takes it: None for ``"auto"``."""
        return None if self.decode_impl == "auto" else self.decode_impl

    def describe(self) -> str:
        """One log line: ``kvrepro settings: preset=k4v4 decode_impl=auto num_splits=auto prefill=fa ...``."""
        parts = []
        for d in SETTINGS:
            v = getattr(self, d.field)
            parts.append(f"{d.field}={'auto' if v is None else int(v) if isinstance(v, bool) else v}")
        return LOG_PREFIX + " ".join(parts)


def described_in(text: str) -> dict[str, str] | None:
    """The first :meth:`Settings.describe` line in ``text`` (a server or engine log) read back as ``{field: value}``
    strings (``{"preset": "k4v4", "key_offset": "rope-mean", ...}``); None where no line has it (an fp8 or bf16
    engine)."""
    for line in text.splitlines():
        if LOG_PREFIX in line:
            return dict(kv.split("=", 1) for kv in line.split(LOG_PREFIX, 1)[1].split() if "=" in kv)
    return None


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``KVREPRO_*`` variables set in ``environ`` (default ``os.environ``) that no setting declares (a typo, or an
    experiment that is not part of kvrepro), sorted. The backend logs a warning naming them at engine start."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(PREFIX) and k not in BY_ENV and k not in NOT_SETTINGS)


def settings_table() -> list[dict[str, str]]:
    """One row per variable: ``{"variable", "values", "default", "changes", "effect"}`` (strings, declaration
    order; ``effect``: the measured effect, see :class:`Declaration`)."""
    return [{"variable": d.env, "values": d.values, "default": d.default or "unset", "changes": d.doc,
             "effect": d.effect} for d in SETTINGS]


def markdown_table() -> str:
    """:func:`settings_table` as a Markdown table."""
    lines = ["| variable | values | default | what it changes | measured effect |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{r['variable']}` | {r['values']} | {r['default']} | {r['changes']} | {r['effect']} |"
              for r in settings_table()]
    return "\n".join(lines)


def _main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="python -m kvrepro.settings",
        description="Print the table of every KVREPRO_* variable and the settings this environment resolves to (what "
        "an engine started here would log); exit 1 on a bad value or a combination the engine refuses.").parse_args(argv)
    try:
        s = Settings.from_env()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if s.conflicts():
        print("\n".join(f"error: {c}" for c in s.conflicts()), file=sys.stderr)
        return 1
    resolved = s.describe()
    print(markdown_table())
    print("\n" + resolved)
    unknown = unknown_variables()
    if unknown:
        print(f"unknown KVREPRO_ variables (ignored): {', '.join(unknown)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(_main))
