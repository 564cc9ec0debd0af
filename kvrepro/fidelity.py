"""Fidelity of a KV format on real prose: KL divergence against bf16, top-1 agreement and perplexity.

What the field asks of a new KV-cache type, measured side by side with fp8 (the format users deploy). The model
reads windows of natural prose (``kvrepro.corpus``, default the offline public-domain ``pd-books``); for every
scored position (the last ``window_tokens - score_from`` tokens of each window, so every scored token has
``score_from`` .. ``window_tokens - 1`` tokens of context) we compare the next-token distribution of a format
``Q`` with the bf16 baseline ``P`` on the same engine:

- ``kl``: KL(P || Q) = sum_t p(t) (log p(t) - log q(t)) over the full vocabulary, nats per token (CPU path);
- ``kl_topk``: the same on the partition {bf16's top-k tokens} + {the rest}, where a bf16 top-k token outside
  the format's own top-k is counted at the format's k-th probability (an upper bound of its q). This is what an
  engine that returns only the top-k log-probs (vLLM's ``prompt_logprobs=k``) allows; both engines report it,
  so they can be compared, and the CPU path reports both, so its gap to the full KL is visible;
- ``top1``: the format's most likely token equals bf16's, percent of positions;
- ``ppl``: exp(mean negative log-likelihood of the actual next token); ``ppl_change_pct`` against bf16's on the
  same tokens.

Methods: KL and top-1 agreement against the unquantized model are the KV-quantization field's fidelity
measures next to perplexity (e.g. KVQuant, Hooper et al. 2024, arXiv:2401.18079; llama.cpp's
``llama-perplexity --kl-divergence`` reports the same trio for quantized models).

Two engines:

- **CPU reference path** (``run_cpu``): ``kvrepro.hf`` with every layer's K/V stored as the format's page bytes;
  one forward pass per window, every position attends to K/V read back from the pages (its own included), as a
  decode step does. Full vocabulary.
- **vLLM** (``run_vllm``, GPU): one prompt per window with ``prompt_logprobs=top_k``; kvrepro presets run with
  ``KVREPRO_PREFILL=fa-pages`` so the chunk's own K/V are read back from the pages too (vLLM's FlashAttention
  backend for bf16/fp8 attends over its paged cache already). Top-k only (``kl_topk``), bf16 matmuls, so its
  bf16 is its own baseline.

Result files (CSV, one row per format and window, provenance columns, written atomically; a rerun with the same
parameters resumes): ``results/fidelity/reference_cpu_*.csv`` and ``results/fidelity/vllm_*.csv``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pandas as pd
import torch

from kvrepro.fileio import atomic_write
from kvrepro.listarg import comma_list
from kvrepro.formats import FORMAT_NAMES
from kvrepro.needle import is_int
from kvrepro.provenance import params_as_dict, params_from_dict

BASELINE = "bf16"
ROW_COLUMNS = ("format", "window", "scored", "kl_sum", "kl_topk_sum", "topk_missing", "top1_sum", "nll_sum",
               "ref_nll_sum")
DEFAULT_CPU_RESULTS = "results/fidelity/reference_cpu_smollm2.csv"   # the file the README's fidelity block reads
DEFAULT_VLLM_RESULTS = "results/fidelity/vllm_h200_smollm2.csv"
# |kl_topk(vLLM) - kl_topk(CPU)| <= AGREEMENT_REL * kl_topk(CPU) + AGREEMENT_ABS, per format (engine_agreement)
AGREEMENT_REL = 0.35
AGREEMENT_ABS = 0.002


@dataclass(frozen=True)
class FidelityParams:
    """What to measure.

    Attributes:
        formats: KV formats (``kvrepro.formats.FORMAT_NAMES``); must include ``"bf16"``, the baseline.
        corpus: a ``kvrepro.corpus.CORPORA`` name.
        window_tokens: tokens per window, in [64, 8192] (SmolLM2's trained window is 8192).
        score_from: first scored position of a window, in [1, window_tokens - 1]; scored positions have at least
            this many tokens of context.
        num_windows: consecutive windows of the corpus, >= 1.
        top_k: k of ``kl_topk``, in [1, 100] (vLLM's ``max_logprobs`` default is 20).
        block_size: tokens per KV page, 16, 32 or 64.
        key_offset: how the compressed presets store keys (``kvrepro.formats.offset.MODES``): ``"rope-mean"``
            (the engines' default), ``"slow-pairs"``, ``"first-prefill"`` or ``"off"``; bf16 and fp8 ignore it.
    """

    formats: tuple = ("bf16", "fp8", "k8v4", "k5v4", "k4v4", "k4v2")
    corpus: str = "pd-books"
    window_tokens: int = 4096
    score_from: int = 2048
    num_windows: int = 50
    top_k: int = 20
    block_size: int = 16
    key_offset: str = "rope-mean"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad parameter and its allowed values."""
        from kvrepro.corpus import CORPORA

        if not isinstance(self.formats, (tuple, list)) or not self.formats:
            raise ValueError(f"formats must be a non-empty list from {FORMAT_NAMES}, got {self.formats!r}")
        bad = [f for f in self.formats if f not in FORMAT_NAMES]
        if bad:
            raise ValueError(f"formats: unknown {bad}; allowed: {', '.join(FORMAT_NAMES)}")
        if BASELINE not in self.formats:
            raise ValueError(f"formats must include the baseline {BASELINE!r}, got {list(self.formats)}")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats has duplicates: {list(self.formats)}")
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus {self.corpus!r} is not known; allowed: {', '.join(CORPORA)}")
        if not is_int(self.window_tokens) or not 64 <= self.window_tokens <= 8192:
            raise ValueError(f"window_tokens must be an integer in [64, 8192], got {self.window_tokens!r}")
        if not is_int(self.score_from) or not 1 <= self.score_from < self.window_tokens:
            raise ValueError(f"score_from must be an integer in [1, window_tokens - 1 = {self.window_tokens - 1}], "
                             f"got {self.score_from!r}")
        if not is_int(self.num_windows) or self.num_windows < 1:
            raise ValueError(f"num_windows must be a positive integer, got {self.num_windows!r}")
        if not is_int(self.top_k) or not 1 <= self.top_k <= 100:
            raise ValueError(f"top_k must be an integer in [1, 100], got {self.top_k!r}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size!r}")
        from kvrepro.formats.offset import check_mode

        check_mode(self.key_offset)

    @property
    def scored_per_window(self) -> int:
        return self.window_tokens - self.score_from

    @property
    def scored_tokens(self) -> int:
        return self.num_windows * self.scored_per_window

    def as_dict(self) -> dict:
        return params_as_dict(self)

    def key(self) -> str:
        """Hash of what a row depends on (not the format list, not the window count: window i is the same for any
        ``num_windows`` > i): rows with the same key are interchangeable, so a longer run resumes a shorter one."""
        d = {k: v for k, v in self.as_dict().items() if k not in ("formats", "num_windows")}
        if d["key_offset"] == "off":   # rows measured before the key offset existed were stored without it
            del d["key_offset"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict) -> "FidelityParams":
        return params_from_dict(cls, d, "fidelity parameter")


# ---------------------------------------------------------------- metrics (both engines)

def topk_kl(ref_ids: torch.Tensor, ref_lp: torch.Tensor, mode_ids: torch.Tensor, mode_lp: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P || Q) on the partition {P's top-k tokens} + {rest}, per position (module docstring, ``kl_topk``).

    Args:
        ref_ids, ref_lp: int ``[N, k]`` token ids and float log-probs of P's top-k (any order).
        mode_ids, mode_lp: the same for Q's top-k.

    Returns:
        ``(kl [N] float64, missing [N] int64)``: missing = P top-k tokens absent from Q's top-k (counted at Q's
        smallest returned probability, an upper bound of their q).

    Raises:
        ValueError: shapes differ or are not ``[N, k]``.
    """
    if ref_ids.shape != ref_lp.shape or mode_ids.shape != mode_lp.shape or ref_ids.dim() != 2 \
            or ref_ids.shape[0] != mode_ids.shape[0]:
        raise ValueError(f"topk_kl needs [N, k] ids and log-probs for both, got {tuple(ref_ids.shape)}, "
                         f"{tuple(ref_lp.shape)}, {tuple(mode_ids.shape)}, {tuple(mode_lp.shape)}")
    ref_lp, mode_lp = ref_lp.double(), mode_lp.double()
    match = ref_ids[:, :, None] == mode_ids[:, None, :]                        # [N, kP, kQ]
    found = match.any(-1)
    q_found = torch.where(match, mode_lp[:, None, :], torch.full_like(mode_lp[:, None, :], -math.inf)).amax(-1)
    q_floor = mode_lp.amin(-1, keepdim=True).expand_as(q_found)
    lq = torch.where(found, q_found, q_floor)
    p = ref_lp.exp()
    kl = (p * (ref_lp - lq)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - lq.exp().sum(-1)).clamp_min(1e-12)
    kl = kl + torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()),
                          torch.zeros_like(p_rest))
    return kl, (~found).sum(-1)


def window_row(fmt: str, window: int, ref_lp: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor,
               top_k: int) -> dict:
    """One result row from full log-probs ``[N, V]`` (bf16 ``ref_lp``, format ``lp``) and the actual next tokens
    ``targets`` (int ``[N]``)."""
    ref_lp, lp = ref_lp.double(), lp.double()
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    rv, ri = ref_lp.topk(top_k, -1)
    mv, mi = lp.topk(top_k, -1)
    klk, missing = topk_kl(ri, rv, mi, mv)
    t = targets[:, None]
    return {"format": fmt, "window": window, "scored": int(targets.numel()), "kl_sum": float(kl.sum()),
            "kl_topk_sum": float(klk.sum()), "topk_missing": int(missing.sum()),
            "top1_sum": int((ri[:, 0] == mi[:, 0]).sum()), "nll_sum": float(-lp.gather(1, t).sum()),
            "ref_nll_sum": float(-ref_lp.gather(1, t).sum())}


def _top_k(g: pd.DataFrame) -> int:
    return int(g["top_k"].iloc[0]) if "top_k" in g and len(g) else 1


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """Per format: scored tokens, windows, mean KL (nats/token; NaN where only top-k was measured), mean top-k KL,
    top-1 agreement %, perplexity and its change against bf16 on the same windows (%).

    Each format is compared with bf16 on the windows both measured (``windows``, ``scored_tokens``), so a
    format measured on fewer windows is still compared on the same tokens as its baseline.
    """
    if rows.empty or BASELINE not in set(rows["format"]):
        return pd.DataFrame()
    base_windows = set(rows.loc[rows["format"] == BASELINE, "window"])
    out = []
    for fmt, g in rows.groupby("format", sort=False):
        g = g[g["window"].isin(base_windows)]
        if g.empty:
            continue
        n = g["scored"].sum()
        ppl, ref_ppl = math.exp(g["nll_sum"].sum() / n), math.exp(g["ref_nll_sum"].sum() / n)
        out.append({"format": fmt, "scored_tokens": int(n), "windows": int(g["window"].nunique()),
                    "kl": g["kl_sum"].sum() / n if g["kl_sum"].notna().all() else float("nan"),
                    "kl_topk": g["kl_topk_sum"].sum() / n, "top1_pct": 100.0 * g["top1_sum"].sum() / n,
                    "ppl": ppl, "ppl_change_pct": 100.0 * (ppl / ref_ppl - 1.0),
                    "topk_missing_pct": 100.0 * g["topk_missing"].sum() / (n * _top_k(g))})
    return pd.DataFrame(out)


def goal_check(summary: pd.DataFrame, reference: str = "fp8", kl_column: str = "kl") -> pd.DataFrame:
    """Per format: ``meets_fp8`` = mean KL <= fp8's and perplexity change <= fp8's (issue 21's goal), with both
    differences. Raises ValueError if ``reference`` is not in ``summary``."""
    if reference not in set(summary["format"]):
        raise ValueError(f"goal_check needs the reference format {reference!r} in the summary")
    r = summary.set_index("format").loc[reference]
    t = summary[["format", kl_column, "ppl_change_pct"]].copy()
    t["kl_vs_fp8"] = t[kl_column] / r[kl_column]
    t["meets_fp8"] = (t[kl_column] <= r[kl_column]) & (t["ppl_change_pct"] <= r["ppl_change_pct"])
    return t


def engine_agreement(cpu: pd.DataFrame, vllm: pd.DataFrame, rel: float = AGREEMENT_REL,
                     abs_tol: float = AGREEMENT_ABS) -> pd.DataFrame:
    """Per format in both summaries: the top-k KL of each engine and whether they agree within
    ``rel x CPU + abs_tol`` (each engine against its own bf16)."""
    m = cpu[["format", "kl_topk"]].merge(vllm[["format", "kl_topk"]], on="format", suffixes=("_cpu", "_vllm"))
    m = m[m["format"] != BASELINE]
    m["tolerance"] = rel * m["kl_topk_cpu"] + abs_tol
    m["agree"] = (m["kl_topk_vllm"] - m["kl_topk_cpu"]).abs() <= m["tolerance"]
    return m


# ---------------------------------------------------------------- result files

def _provenance(engine: str, params: FidelityParams) -> dict:
    from kvrepro.provenance import collect

    prov = collect()
    return {"engine": engine, "params_key": params.key(), "params": json.dumps(params.as_dict(), sort_keys=True),
            "top_k": params.top_k, "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "provenance": json.dumps(prov, sort_keys=True, default=str)}


def read_rows(path: str) -> pd.DataFrame:
    """Rows of a result file (empty frame if it does not exist)."""
    if not os.path.exists(path):
        return pd.DataFrame(columns=list(ROW_COLUMNS))
    return pd.read_csv(path)


def write_rows(df: pd.DataFrame, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return atomic_write(path, lambda f: df.to_csv(f, index=False))


# ---------------------------------------------------------------- CPU reference path

def corpus_windows(tokenizer, params: FidelityParams) -> list[list[int]]:
    """The ``num_windows`` consecutive windows of ``params.corpus`` (ValueError if the corpus is too short).

    With ``FIDELITY_WINDOWS_FILE`` unset this tokenizes the corpus (needs ``datasets``); a machine without
    it (a GPU box without network) reads the windows saved by ``save_windows`` on another machine instead, after
    checking they were made for the same corpus, window length and count."""
    path = os.environ.get("FIDELITY_WINDOWS_FILE", "")
    if path:
        d = torch.load(path)
        want = {"corpus": params.corpus, "window_tokens": params.window_tokens, "num_windows": params.num_windows}
        got = {k: d.get(k) for k in want}
        if got != want:
            raise ValueError(f"FIDELITY_WINDOWS_FILE {path} holds windows for {got}, not {want}")
        return d["windows"]
    from kvrepro.corpus import token_windows

    return token_windows(tokenizer, params.corpus, params.window_tokens, params.num_windows)


def save_windows(tokenizer, params: FidelityParams, path: str) -> str:
    """Save the corpus windows of ``params`` for a machine without ``datasets`` (``FIDELITY_WINDOWS_FILE``)."""
    from kvrepro.corpus import load_text

    _, prov = load_text(params.corpus)
    d = {"corpus": params.corpus, "window_tokens": params.window_tokens, "num_windows": params.num_windows,
         "corpus_provenance": prov, "windows": corpus_windows(tokenizer, params)}
    return atomic_write(path, lambda f: torch.save(d, f), "wb")


@torch.inference_mode()
def _cpu_logprobs(model, window: list[int], fmt: str, params: FidelityParams) -> torch.Tensor:
    from kvrepro.formats import get_format
    from kvrepro.hf import forward, make_cache, rope_info

    f = get_format(fmt)
    ko = params.key_offset if f.default_key_offset != "off" else "off"
    cache = make_cache(f, model.config.num_hidden_layers, params.block_size, key_offset=ko, rope=rope_info(model))
    keep = params.window_tokens - params.score_from + 1  # logits of positions score_from - 1 .. window - 1

    dev = next(model.parameters()).device
    out = forward(model, torch.tensor([window], device=dev), cache, logits_to_keep=keep)
    return torch.log_softmax(out.logits[0, :-1].float(), -1).cpu()


def run_cpu(params: FidelityParams | dict, path: str, progress: bool = False, model=None, tokenizer=None,
            device: str = "cpu") -> pd.DataFrame:
    """Measure every format on every window through the CPU reference path; append rows to ``path``.

    ``device``: where the reference path runs (``"cpu"``, or ``"cuda"`` for the same code in float32 on a GPU,
    recorded in every row's ``engine`` as ``reference-<device>``; TF32 is switched off so float32 stays float32).

    Resumes: a (format, window) already in ``path`` with the same ``params.key()`` is not measured again; rows
    of other parameters are kept. The file is rewritten atomically after every window, so an interruption
    keeps the finished windows. Returns all rows of ``path`` with this key.

    Raises:
        ValueError: bad parameters (``FidelityParams.validate``) or a corpus too short for the windows (before
            anything is measured).
    """
    if isinstance(params, dict):
        params = FidelityParams.from_dict(params)
    params.validate()
    if model is None:
        from kvrepro.hf import load_smollm2

        model, tokenizer = load_smollm2()
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = model.to(device)
    windows = corpus_windows(tokenizer, params)
    key = params.key()
    df = read_rows(path)
    have = set()
    if not df.empty and "params_key" in df:
        mine = df[df["params_key"] == key]
        have = set(zip(mine["format"], mine["window"]))
    prov = _provenance("reference-cpu" if device == "cpu" else f"reference-{device}", params)
    it = range(len(windows))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="fidelity windows")
    for w in it:
        todo = [f for f in params.formats if (f, w) not in have]
        if not todo:
            continue
        tgt = torch.tensor(windows[w][params.score_from:params.window_tokens])
        ref = _cpu_logprobs(model, windows[w], BASELINE, params)
        new = []
        for fmt in params.formats:
            if (fmt, w) in have:
                continue
            lp = ref if fmt == BASELINE else _cpu_logprobs(model, windows[w], fmt, params)
            new.append({**window_row(fmt, w, ref, lp, tgt, params.top_k), **prov})
        df = pd.concat([df, pd.DataFrame(new)], ignore_index=True) if not df.empty else pd.DataFrame(new)
        write_rows(df, path)
    return df[df["params_key"] == key].reset_index(drop=True)


# ---------------------------------------------------------------- vLLM path (GPU)

def vllm_worker(mode: str, windows_path: str, model: str, out_path: str, top_k: int, score_from: int,
                gpu_memory_utilization: float = 0.3, kv_cache_memory_bytes: int | None = None) -> None:
    """One mode in this process: every window as one prompt with ``prompt_logprobs=top_k``; saves the scored
    positions' top-k ids / log-probs and the actual tokens' log-probs to ``out_path`` (torch.save, atomic).
    ``kv_cache_memory_bytes``: a fixed KV-cache size (no memory profiling: engines started at once on one GPU)."""
    from kvrepro.accuracy_vllm import mode_settings

    s = mode_settings(mode)
    for k, v in s["env"].items():
        if os.environ.get(k) != v:
            raise ValueError(f"mode {mode} needs {k}={v} in the environment before vLLM starts")
    if s["attention_backend"] == "CUSTOM":
        if os.environ.get("KVREPRO_PREFILL") != "fa-pages":
            raise ValueError("kvrepro modes need KVREPRO_PREFILL=fa-pages (scored positions read the pages)")
        from kvrepro.vllm_backend import register

        register()
    from vllm import LLM, SamplingParams

    windows = torch.load(windows_path)
    n_tok = max(len(w) for w in windows)
    kw = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max(n_tok + 1, 256),
              kv_cache_dtype=s["kv_cache_dtype"], gpu_memory_utilization=gpu_memory_utilization, seed=0,
              enable_prefix_caching=False, block_size=16, max_num_seqs=8, max_logprobs=top_k,
              max_num_batched_tokens=max(n_tok, 2048), enforce_eager=True)
    if s["attention_backend"]:
        kw["attention_backend"] = s["attention_backend"]
    if kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    run_s = time.perf_counter() - t0
    res = []
    for w, o in zip(windows, outs):
        plp = o.prompt_logprobs
        n = len(w) - score_from
        ids = torch.zeros(n, top_k, dtype=torch.int32)
        lps = torch.full((n, top_k), -math.inf, dtype=torch.float32)
        act = torch.zeros(n, dtype=torch.float32)
        for i, j in enumerate(range(score_from, len(w))):
            d = plp[j]
            act[i] = d[w[j]].logprob
            top = sorted(((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= top_k))
            for r, (_, t, lp) in enumerate(top[:top_k]):
                ids[i, r], lps[i, r] = t, lp
        res.append({"ids": ids, "lps": lps, "actual": act})
    info = {"mode": mode, "engine_init_s": round(init_s, 1), "run_s": round(run_s, 1),
            "engine_kwargs": {k: v for k, v in kw.items() if k != "model"},
            "env": {k: v for k, v in os.environ.items() if k.startswith("KVREPRO_")}}
    atomic_write(out_path, lambda f: torch.save({"windows": res, "info": info}, f), "wb")


def vllm_rows(ref: dict, res: dict, fmt: str, top_k: int) -> list[dict]:
    """Result rows of one mode from two ``vllm_worker`` outputs (bf16 ``ref`` and the mode's ``res``)."""
    rows = []
    for w, (a, b) in enumerate(zip(ref["windows"], res["windows"])):
        kl, missing = topk_kl(a["ids"].long(), a["lps"], b["ids"].long(), b["lps"])
        rows.append({"format": fmt, "window": w, "scored": int(b["actual"].numel()), "kl_sum": float("nan"),
                     "kl_topk_sum": float(kl.sum()), "topk_missing": int(missing.sum()),
                     "top1_sum": int((a["ids"][:, 0] == b["ids"][:, 0]).sum()),
                     "nll_sum": float(-b["actual"].double().sum()), "ref_nll_sum": float(-a["actual"].double().sum())})
    return rows


def run_vllm(params: FidelityParams | dict, path: str, model: str, work_dir: str, modes=None,
             timeout_s: float = 600.0, parallel: int = 1) -> pd.DataFrame:
    """Measure through vLLM (GPU): each mode in its own subprocess (``vllm_worker``), then rows against bf16.

    ``modes`` default: ``bf16``, ``fp8`` and ``kvrepro:<preset>`` for every compressed format of
    ``params.formats``. ``model``: a HF model directory (SmolLM2 de-quantized: ``kvrepro.accuracy_vllm``).
    ``parallel``: modes run at once on the visible GPU (each engine takes ``0.9 / parallel`` of its memory, at most
    0.3; with ``parallel > 1`` a fixed 4 GiB KV cache, vLLM's ``kv_cache_memory_bytes``, since engines profiling
    memory at the same time would count each other's). A mode's rows are written (atomically, replacing rows of the same parameters key and format) as soon as it
    and bf16 have finished, so a timeout keeps the modes already measured.

    Raises:
        ValueError: ``modes`` not starting with ``bf16``; ``parallel`` not a positive int.
        RuntimeError: bf16 failed (no rows can be computed).
    """
    from kvrepro.accuracy_vllm import mode_env
    from kvrepro.hf import load_smollm2

    if isinstance(params, dict):
        params = FidelityParams.from_dict(params)
    params.validate()
    if not is_int(parallel) or parallel < 1:
        raise ValueError(f"parallel must be a positive integer, got {parallel!r}")
    if modes is None:
        modes = [f if f in ("bf16", "fp8") else f"kvrepro:{f}" for f in params.formats]
    _, tok = load_smollm2()
    windows = corpus_windows(tok, params)
    if modes[0] != "bf16":
        raise ValueError(f"modes must start with the baseline 'bf16', got {list(modes)}")
    prov = _provenance("vllm", params)
    os.makedirs(work_dir, exist_ok=True)
    wpath = os.path.join(work_dir, "windows.pt")
    atomic_write(wpath, lambda f: torch.save(windows, f), "wb")
    mem = min(0.3, 0.9 / parallel)
    pending, running, outs, written = list(modes), {}, {}, set()

    def start(mode):
        tag = mode.replace(":", "_")
        out, log = os.path.join(work_dir, f"{tag}.pt"), os.path.join(work_dir, f"{tag}.log")
        if os.path.exists(out):
            os.remove(out)
        env = mode_env(mode, dict(os.environ))
        if mode.startswith("kvrepro:"):
            env["KVREPRO_PREFILL"] = "fa-pages"
            env["KVREPRO_KEY_OFFSET"] = params.key_offset
        cmd = [sys.executable, "-m", "kvrepro.fidelity", "vllm-worker", "--mode", mode, "--windows", wpath,
               "--model", model, "--out", out, "--top-k", str(params.top_k), "--score-from", str(params.score_from),
               "--gpu-memory-utilization", str(mem)] + (["--kv-cache-gib", "4"] if parallel > 1 else [])
        lf = open(log, "w")
        proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        running[mode] = dict(proc=proc, lf=lf, t0=time.perf_counter(), out=out, log=log)

    def write(mode):
        fmt = mode.split(":", 1)[-1]
        info = json.dumps(outs[mode]["info"], sort_keys=True)
        rows = [{**r, **prov, "mode": mode, "engine_info": info}
                for r in vllm_rows(outs["bf16"], outs[mode], fmt, params.top_k)]
        df = read_rows(path)
        if not df.empty and "params_key" in df:
            df = df[~((df["params_key"] == params.key()) & (df["format"] == fmt))]
        df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True) if not df.empty else pd.DataFrame(rows)
        write_rows(df, path)
        written.add(mode)

    while pending or running:
        while pending and len(running) < parallel:
            start(pending.pop(0))
        time.sleep(0.5)
        for mode, r in list(running.items()):
            rc, wall = r["proc"].poll(), time.perf_counter() - r["t0"]
            if rc is None and wall <= timeout_s:
                continue
            if rc is None:
                os.killpg(r["proc"].pid, 9)
                r["proc"].wait()
            r["lf"].close()
            del running[mode]
            print(f"fidelity vllm {mode}: rc={rc} {wall:.0f}s", flush=True)
            if rc != 0 or not os.path.exists(r["out"]):
                print(open(r["log"]).read()[-3000:], flush=True)
                if mode == "bf16":
                    for m, o in running.items():
                        os.killpg(o["proc"].pid, 9)
                    raise RuntimeError("the bf16 baseline did not run through vLLM; no rows written (see "
                                       f"{r['log']})")
                continue
            outs[mode] = torch.load(r["out"])
        if "bf16" in outs:
            for mode in modes:
                if mode in outs and mode not in written:
                    write(mode)
    return read_rows(path)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvrepro.fidelity", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="the CPU reference path (writes/resumes --out)")
    v = sub.add_parser("vllm", help="through vLLM on a GPU (every mode in its own process)")
    for p in (c, v):
        p.add_argument("--formats", default=",".join(FidelityParams.formats),
                       help="comma-separated KV formats, bf16 first (default %(default)s)")
        p.add_argument("--corpus", default=FidelityParams.corpus,
                       help="kvrepro.corpus.CORPORA name (default %(default)s, offline)")
        p.add_argument("--window-tokens", type=int, default=FidelityParams.window_tokens,
                       help="tokens per window, 64..8192 (default %(default)s)")
        p.add_argument("--score-from", type=int, default=FidelityParams.score_from,
                       help="first scored position of each window (default %(default)s)")
        p.add_argument("--num-windows", type=int, default=FidelityParams.num_windows,
                       help="consecutive corpus windows, >= 1 (default %(default)s)")
        p.add_argument("--top-k", type=int, default=FidelityParams.top_k,
                       help="k of the top-k KL, 1..100 (default %(default)s: vLLM's max_logprobs)")
        p.add_argument("--key-offset", default=FidelityParams.key_offset,
                       help="how compressed presets store keys (the reference path's KVREPRO_KEY_OFFSET): rope-mean "
                       "(default), slow-pairs, first-prefill or off")
    c.add_argument("--out", default=DEFAULT_CPU_RESULTS, help=f"results CSV, appended / resumed (default "
                   f"{DEFAULT_CPU_RESULTS}, the file the README's fidelity block reads)")
    c.add_argument("--device", default="cpu", help="cpu, or cuda: the same reference path in float32 on a GPU")
    v.add_argument("--out", default=DEFAULT_VLLM_RESULTS)
    v.add_argument("--model", required=True, help="HF model directory (SmolLM2 de-quantized)")
    v.add_argument("--work-dir", required=True)
    v.add_argument("--parallel", type=int, default=1, help="modes at once on the GPU (default 1)")
    w = sub.add_parser("vllm-worker")
    for a in ("--mode", "--windows", "--model", "--out"):
        w.add_argument(a, required=True)
    w.add_argument("--top-k", type=int, required=True)
    w.add_argument("--score-from", type=int, required=True)
    w.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    w.add_argument("--kv-cache-gib", type=float, default=0.0, help="fixed KV-cache size (0: vLLM's profiling)")
    a = ap.parse_args(argv)
    if a.cmd == "vllm-worker":
        vllm_worker(a.mode, a.windows, a.model, a.out, a.top_k, a.score_from, a.gpu_memory_utilization,
                    int(a.kv_cache_gib * 2**30) or None)
        return 0
    params = FidelityParams(formats=tuple(comma_list(a.formats, "--formats")), corpus=a.corpus,
                            window_tokens=a.window_tokens, score_from=a.score_from, num_windows=a.num_windows,
                            top_k=a.top_k, key_offset=a.key_offset)
    try:
        params.validate()
    except ValueError as e:      # a usage error: argparse's message and exit code 2, not a traceback
        ap.error(str(e))
    if a.cmd == "cpu" and a.device not in ("cpu", "cuda") and not a.device.startswith("cuda:"):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {a.device!r}")
    if a.cmd == "cpu":
        rows = run_cpu(params, a.out, progress=True, device=a.device)
    else:
        rows = run_vllm(params, a.out, a.model, a.work_dir, parallel=a.parallel)
    print(summarize(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
