"""Passkey retrieval accuracy of a real model per KV format (notebook 03's engine).

For every cell (context length x needle depth x key) one prompt is built (``kvrepro.needle``)
and served once per KV format through ``kvrepro.hf`` (KV stored as that format's pages,
attention over the dequantized pages for every position, prefill included). Per run:
greedy answer + whole-number score, and the teacher-forced log-probabilities of the key
digits (a continuous margin: greedy success is decided at the first digit, so pass/fail alone
is coarse). The prompt is identical across formats (its SHA-256 is in every row).
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass

import pandas as pd
import torch

from kvrepro.formats import FORMAT_NAMES, get_format
from kvrepro.hf import greedy_generate, kv_bytes, load_smollm2, make_cache, prefill, teacher_forced_logprobs
from kvrepro.needle import answer_decided, build_prompt, make_keys, score_answer

BASELINE = "bf16"
MIN_BASELINE_ACCURACY = 0.9


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
    """

    formats: tuple = FORMAT_NAMES
    context_lengths: tuple = (1024, 2048, 4096)
    depths: tuple = (0.0, 0.33, 0.67, 1.0)
    num_keys: int = 2
    seed: int = 0
    max_new_tokens: int = 8
    block_size: int = 16
    results_path: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "AccuracyParams":
        """Build and validate from a dict (unknown keys raise ``ValueError`` naming them)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}; allowed: {sorted(names)}")
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter and the allowed values."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

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
        if not isinstance(self.depths, (tuple, list)) or not self.depths:
            raise ValueError(f"depths must be a non-empty list, got {self.depths!r}")
        for x in self.depths:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
                raise ValueError(f"depths: {x!r} is not a number in [0, 1]")
        if not is_int(self.num_keys) or self.num_keys < 1:
            raise ValueError(f"num_keys must be a positive integer, got {self.num_keys!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= 64:
            raise ValueError(f"max_new_tokens must be an integer in [1, 64], got {self.max_new_tokens!r}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be one of (16, 32, 64), got {self.block_size!r}")
        if not isinstance(self.results_path, str):
            raise ValueError(f"results_path must be a string, got {self.results_path!r}")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def run_one(model, tokenizer, prompt, fmt_name: str, max_new_tokens: int, block_size: int = 16) -> dict:
    """Serve ``prompt`` (a ``NeedlePrompt``) with KV format ``fmt_name``; return one result row."""
    cache = make_cache(get_format(fmt_name), model.config.num_hidden_layers, block_size)
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
        "format": fmt_name, "context_length": prompt.context_length, "depth": prompt.depth,
        "key": prompt.key, "n_tokens": prompt.n_tokens, "prompt_sha256": prompt.sha256,
        "answer": text, "correct": score_answer(text, prompt.key),
        "key_logprob_mean": float(lps.mean()), "first_digit_logprob": float(lps[0]),
        "prefill_s": t1 - t0, "decode_s": t3 - t2, "decode_tokens": len(out), "kv_bytes": stored,
        "amax_key": max(layer.amax_key for layer in cache.layers),
        "amax_value": max(layer.amax_value for layer in cache.layers),
    }


def run_grid(params: AccuracyParams | dict, progress: bool = True) -> pd.DataFrame:
    """Run every (length, depth, key) prompt through every format; one row per run.

    Columns: see ``run_one`` (``format, context_length, depth, key, n_tokens, prompt_sha256,
    answer, correct, key_logprob_mean [nats/token], first_digit_logprob [nats], prefill_s,
    decode_s, decode_tokens, kv_bytes, amax_key, amax_value``).

    Raises:
        ValueError: bad parameters (before the model is loaded).
    """
    if isinstance(params, dict):
        params = AccuracyParams.from_dict(params)
    params.validate()
    from tqdm import tqdm  # text bar: renders in papermill/nbconvert output without ipywidgets

    model, tok = load_smollm2()
    keys = make_keys(params.num_keys, params.seed)
    cells = [(n, d, k) for n in params.context_lengths for d in params.depths for k in keys]
    rows = []
    bar = tqdm(total=len(cells) * len(params.formats), desc="passkey runs", disable=not progress)
    for n, d, k in cells:
        prompt = build_prompt(tok, n, float(d), k)
        for f in params.formats:
            rows.append(run_one(model, tok, prompt, f, params.max_new_tokens, params.block_size))
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    df["format"] = pd.Categorical(df["format"], categories=list(params.formats), ordered=True)
    return df


def check_same_prompts(df: pd.DataFrame) -> None:
    """Raise ``ValueError`` unless every cell's prompt hash is the same for all formats."""
    per_cell = df.groupby(["context_length", "depth", "key"], observed=True)["prompt_sha256"].nunique()
    if (per_cell != 1).any():
        raise ValueError(f"prompts differ across formats in {int((per_cell != 1).sum())} cells")


def with_baseline_delta(df: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Add ``delta_correct`` and ``delta_logprob``: this run minus the baseline run on the same prompt."""
    base = df[df["format"] == baseline].set_index("prompt_sha256")
    out = df.copy()
    out["delta_correct"] = out["correct"] - out["prompt_sha256"].map(base["correct"])
    out["delta_logprob"] = out["key_logprob_mean"] - out["prompt_sha256"].map(base["key_logprob_mean"])
    return out


def summarize(df: pd.DataFrame, head_dim: int = 64) -> pd.DataFrame:
    """One row per format: runs, correct, accuracy, mean key log-prob, deltas vs bf16 (same
    prompts), mean prefill/decode time, stored KV bytes per token (all layers) and B/token/head."""
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
                  vmin: float | None = None, vmax: float | None = None, center: float | None = None):
    """One seaborn heatmap per format of ``value`` over (context length x depth), one colour scale
    for all formats (symmetric around ``center`` when given); returns the figure."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    tables = cell_table(df, value)
    allv = pd.concat([t.stack() for t in tables.values()])
    if center is not None and vmin is None and vmax is None:  # symmetric around center, one scale for all
        r = max(float((allv - center).abs().max()), 1e-3)
        vmin, vmax = center - r, center + r
    vmin = float(allv.min()) if vmin is None else vmin
    vmax = float(allv.max()) if vmax is None else vmax
    fig, axes = plt.subplots(1, len(tables), figsize=(3.2 * len(tables), 2.8), squeeze=False)
    for ax, (f, t) in zip(axes[0], tables.items()):
        sns.heatmap(t, ax=ax, annot=True, fmt=".2f", cmap=cmap, vmin=vmin, vmax=vmax, center=center,
                    cbar=False, annot_kws={"size": 7})
        ax.set_title(str(f))
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens" if ax is axes[0][0] else "")
    fig.suptitle(title)
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


def save_results(df: pd.DataFrame, params: AccuracyParams, path: str, provenance: dict) -> str:
    """Write ``df`` as CSV to ``path`` (``resolve_path``) and the resolved run config + provenance
    as ``<path>.json`` beside it; each through a temp file then rename. Returns the CSV path."""
    path = resolve_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"params": params.as_dict(), "provenance": provenance, "measured": True}
    for target, write in ((path, lambda f: df.to_csv(f, index=False)),
                          (path + ".json", lambda f: json.dump(meta, f, indent=1, default=str))):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(target)), suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            write(fh)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, target)
    return path


def plot_cost(df: pd.DataFrame):
    """Seaborn bars per format over context length: prefill seconds and stored KV bytes per token
    (all layers); returns the figure. CPU wall-clock of this PyTorch reference path, not a kernel speed."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    d = df.assign(kv_bytes_per_token=df["kv_bytes"] / df["n_tokens"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    sns.barplot(d, x="context_length", y="prefill_s", hue="format", ax=axes[0], errorbar=None)
    axes[0].set(title="prefill wall-clock (s), CPU", xlabel="context tokens", ylabel="seconds")
    sns.barplot(d, x="format", y="kv_bytes_per_token", ax=axes[1], errorbar=None, hue="format", legend=False,
                dodge=False)
    axes[1].set(title="stored KV bytes per token (30 layers, whole pages)", xlabel="", ylabel="bytes")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- output sanity, targets, engine agreement
# Pure pandas: shared by the CPU path and the vLLM path (kvrepro.accuracy_vllm, scripts/vllm_accuracy.py).

SANITY_MIN_PREFIX = 4  # tokens: a mode must reproduce bf16's first 4 greedy tokens on at least half the prompts
SANITY_MAX_EXTRA_DUP = 0.10  # and repeat adjacent tokens at most 10 points more often than bf16
TARGET_MIN_BASELINE = 0.95  # cells where bf16 retrieves >= 95% are the ones the target is judged on
AGREEMENT_TOLERANCE = 0.05  # engines agree if per-mode accuracy on the shared cells differs by <= 5 points


def _ids(x) -> list[int]:
    if isinstance(x, str):
        return [int(t) for t in x.split()]
    return [int(t) for t in x]


def sanity_metrics(ref, out) -> dict:
    """Greedy continuation ``out`` vs the bf16 continuation ``ref`` of the same prompt (token ids,
    lists or space-separated strings).

    Returns ``first_divergence`` (tokens equal before the first difference), ``prefix_agreement``
    (that / len(ref)), ``token_agreement`` (position-wise equal fraction over len(ref); positions
    missing in ``out`` count as different) and ``dup_rate`` (fraction of adjacent equal tokens in ``out``,
    ``out[i] == out[i-1]``; 0 for fewer than 2 tokens).

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
    return {"first_divergence": first, "prefix_agreement": first / n, "token_agreement": same / n, "dup_rate": dup}


def sanity_table(sanity: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Per format: mean prefix/token agreement with ``baseline`` over the sanity prompts, median first
    divergence, mean duplicate rate, and ``sanity_pass``: median first divergence >= SANITY_MIN_PREFIX
    and dup_rate <= baseline's + SANITY_MAX_EXTRA_DUP. ``sanity`` columns: format, name, output_ids
    (+ engine, ignored). Raises ValueError without baseline rows."""
    base = sanity[sanity["format"] == baseline].set_index("name")["output_ids"]
    if base.empty:
        raise ValueError(f"sanity rows hold no {baseline!r} baseline")
    rows = []
    for (fmt, name), r in sanity.set_index(["format", "name"]).iterrows():
        if name in base.index:
            rows.append(dict(format=fmt, name=name, **sanity_metrics(base[name], r["output_ids"])))
    m = pd.DataFrame(rows)
    g = m.groupby("format", sort=False)
    t = pd.DataFrame({"prompts": g.size(), "prefix_agreement": g["prefix_agreement"].mean(),
                      "token_agreement": g["token_agreement"].mean(),
                      "first_divergence_median": g["first_divergence"].median(), "dup_rate": g["dup_rate"].mean()})
    bdup = t.loc[baseline, "dup_rate"]
    t["sanity_pass"] = (t["first_divergence_median"] >= SANITY_MIN_PREFIX) & (t["dup_rate"] <= bdup + SANITY_MAX_EXTRA_DUP)
    return t


def target_check(df: pd.DataFrame, baseline: str = BASELINE, min_baseline: float = TARGET_MIN_BASELINE) -> pd.DataFrame:
    """Issue-5 target per format and variant: on every (variant, context length, depth) cell where the
    baseline retrieves >= ``min_baseline`` (over keys), the format's accuracy must be >= the baseline's.

    ``df`` columns: format, context_length, depth, correct (+ variant, default "single"). Returns one row
    per (format, variant): cells judged, cells matched, cells below baseline (list), ``meets``.
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
        judged = [c for c in s.index if c in base.index and base[c] >= min_baseline]
        worse = [c for c in judged if s[c] < base[c]]
        rows.append(dict(format=fmt, variant=var, cells_judged=len(judged), cells_matched=len(judged) - len(worse),
                         cells_worse=[f"{c[1]}/{c[2]}" for c in worse],
                         accuracy=float(s.mean()), baseline_accuracy=float(base[[c for c in s.index if c in base.index]].mean()),
                         meets=bool(judged) and not worse))
    return pd.DataFrame(rows).set_index(["format", "variant"])


def engine_agreement(vllm: pd.DataFrame, cpu: pd.DataFrame, tolerance: float = AGREEMENT_TOLERANCE) -> pd.DataFrame:
    """Compare the two engines on the cells both ran (same prompt SHA-256 and format).

    Per format: shared runs, accuracy on each engine, per-run verdict agreement (both right or both
    wrong), and ``agree``: |accuracy difference| <= ``tolerance`` AND the issue-5 target verdict
    (``target_check`` on the shared runs, all variants) is the same on both engines.
    Raises ValueError when no run is shared.
    """
    key = ["format", "prompt_sha256"]
    v = vllm.assign(format=vllm["format"].astype(str))[key + ["correct"]]
    c = cpu.assign(format=cpu["format"].astype(str))[key + ["correct"]]
    m = v.merge(c, on=key, suffixes=("_vllm", "_cpu"))
    if m.empty:
        raise ValueError("the vLLM and CPU rows share no (format, prompt_sha256) run")
    shared = set(m["prompt_sha256"])

    def verdicts(df):
        d = df.assign(format=df["format"].astype(str))
        d = d[d["prompt_sha256"].isin(shared)]
        return target_check(d)["meets"].groupby(level="format").all()

    tv, tc = verdicts(vllm), verdicts(cpu)
    g = m.groupby("format")
    t = pd.DataFrame({"shared_runs": g.size(), "accuracy_vllm": g["correct_vllm"].mean(),
                      "accuracy_cpu": g["correct_cpu"].mean(),
                      "run_agreement": g.apply(lambda x: (x["correct_vllm"] == x["correct_cpu"]).mean())})
    t["accuracy_diff"] = t["accuracy_vllm"] - t["accuracy_cpu"]
    t["target_vllm"] = [bool(tv.get(f, False)) for f in t.index]
    t["target_cpu"] = [bool(tc.get(f, False)) for f in t.index]
    t["agree"] = (t["accuracy_diff"].abs() <= tolerance + 1e-12) & (t["target_vllm"] == t["target_cpu"])
    return t
