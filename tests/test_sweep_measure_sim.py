"""``kvrepro.sweep_worker.measure_mode`` end to end on CPU against a small simulated vLLM engine, and a resumed
sweep after a killed worker.

The stand-in keeps vLLM 0.20.2's scheduling rules that the protocol depends on (FCFS, chunked
prefill under a token budget, whole KV blocks per request plus one null block, a waiting request
is scheduled only if its chunk's blocks are free, a running request that cannot grow preempts the
last running one, preempted requests recompute). It checks the protocol's verdicts against block
arithmetic done here: N that fit, the full window clean, the N+1 edge not clean, abort windows.
"""
import json
import logging
import math
import sys
import types
from types import SimpleNamespace as NS

import pytest
import torch

from kvrepro import sweep
from kvrepro import sweep_worker as worker
from kvrepro.vllm_backend import config as cfg
from kvrepro.vllm_backend import runtime

BS, CHUNK = 16, 512


class FakeRequest:
    def __init__(self, rid, prompt, max_tokens):
        self.request_id, self.prompt, self.max_tokens = rid, len(prompt), max_tokens
        self.num_computed_tokens, self.generated, self.blocks = 0, 0, 0

    def todo(self):
        """Tokens to compute before the next sample: the prompt, then each sampled token (a
        preempted request recomputes prompt + output, as vLLM's recompute preemption does)."""
        return self.prompt + self.generated - self.num_computed_tokens


class FakeEngine:
    """Token-level scheduler over ``num_blocks`` KV blocks of ``BS`` tokens (block 0 is the null block)."""

    def __init__(self, num_blocks):
        self.free = num_blocks - 1
        self.waiting, self.running, self.preemptions = [], [], 0
        self.kv_cache_manager = NS(block_pool=NS(get_num_free_blocks=lambda: self.free))

    def _grow(self, r, n):
        need = math.ceil((r.num_computed_tokens + n) / BS) - r.blocks
        if need > self.free:
            return False
        self.free -= need
        r.blocks += need
        return True

    def _release(self, r):
        self.free += r.blocks
        r.blocks, r.num_computed_tokens = 0, 0

    def step(self):
        budget, out = CHUNK, []
        for r in list(self.running):
            if r not in self.running or budget <= 0:
                continue
            n = min(budget, r.todo())
            while not self._grow(r, n):  # preempt the last running request (FCFS), maybe r itself
                victim = self.running.pop()
                self._release(victim)
                self.preemptions += 1
                self.waiting.insert(0, victim)
                if victim is r:
                    break
            if r in self.running:
                budget -= n
                self._advance(r, n, out)
        while self.waiting and budget > 0:
            r = self.waiting[0]
            n = min(budget, r.todo())
            if not self._grow(r, n):  # a waiting request only waits
                break
            self.running.append(self.waiting.pop(0))
            budget -= n
            self._advance(r, n, out)
        return out

    def _advance(self, r, n, out):
        r.num_computed_tokens += n
        if r.todo() > 0:
            return
        r.generated += 1
        done = r.generated >= r.max_tokens
        out.append(NS(request_id=r.request_id, outputs=[NS(token_ids=[7])], finished=done))
        if done:
            self.running.remove(r)
            self._release(r)

    def abort(self, rids):
        for q in (self.running, self.waiting):
            for r in [r for r in q if r.request_id in rids]:
                q.remove(r)
                self._release(r)


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """measure_mode sets KVREPRO_PRESET / VLLM_ENABLE_V1_MULTIPROCESSING (it owns its process): undo. No engine's
    settings are resolved in this process yet (the simulated engine builds no layers: settings come from the
    environment)."""
    monkeypatch.setenv("KVREPRO_PRESET", "k4v4")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(cfg, "_ENGINE_SETTINGS", {})
    monkeypatch.setattr(cfg, "_LAST", [])
    monkeypatch.setattr(runtime, "DECODE_IMPL_USED", {})


def fake_vllm(num_blocks):
    """A ``vllm`` module whose ``LLM`` drives :class:`FakeEngine` (in-process engine layout of 0.20.2)."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.20.2-sim"
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = NS(DELTA="delta")
    mod.SamplingParams = lambda **kw: NS(**kw)

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            core = FakeEngine(num_blocks)
            logging.getLogger("vllm.v1.worker.gpu_worker").info("Available KV cache memory: %s GiB", "0.50")
            logging.getLogger("vllm.v1.worker.gpu_model_runner").debug(
                "Estimated %s CUDA graph memory: %.2f MiB first-capture + (%d-1) x %.2f MiB per-graph",
                "FULL", 3.0, 7, 1.0)
            cfg = NS(cache_config=NS(num_gpu_blocks=num_blocks),
                     scheduler_config=NS(max_num_batched_tokens=CHUNK),
                     compilation_config=NS(cudagraph_mode=NS(name="FULL_AND_PIECEWISE")))
            engine = NS(vllm_config=cfg, engine_core=NS(engine_core=NS(scheduler=core)))
            engine.add_request = lambda rid, p, params: core.waiting.append(
                FakeRequest(rid, p["prompt_token_ids"], params.max_tokens))
            engine.step = core.step
            engine.abort_request = core.abort
            self.llm_engine, self.core = engine, core

        def get_metrics(self):
            return [NS(name="vllm:num_preemptions", value=self.core.preemptions)]

        def collective_rpc(self, fn):
            return [fn(NS(peak_activation_memory=1, non_torch_memory=2, cudagraph_memory_estimate=3,
                          available_kv_cache_memory_bytes=4, model_runner=NS(model_memory_usage=5)))]

    mod.LLM = LLM
    return {"vllm": mod, "vllm.sampling_params": sp}


def test_measure_mode_on_a_simulated_engine(tmp_path, monkeypatch):
    prompt, decode, window = 4096, 64, 2
    per_user = math.ceil((prompt + decode) / BS)  # 260 blocks; a prompt takes 8 prefill steps
    num_blocks = 3 * per_user + 1 + 4              # 3 users fit with 4 blocks spare; a 4th never does
    for name, m in fake_vllm(num_blocks).items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: NS(total_memory=160 * 2**30))
    path = tmp_path / "sim.jsonl"
    rows = worker.measure_mode("kvrepro:k4v4", str(path), "sim", prompt_tokens=prompt, decode_tokens=decode,
                                window_steps=window, max_users=8, confirm_edge=True, timeout_s=120, block_size=BS)
    by = {(r["measured_by"], r["num_users"]): r for r in rows}
    full = by[("full", 3)]
    assert full["users_fit_arithmetic"] == 3 == sweep.users_fit(num_blocks, prompt, decode, BS)
    assert full["clean"] and full["preemptions"] == 0 and full["all_running_concurrently"]
    assert full["kv_cache_tokens"] == num_blocks * BS and full["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    fp = full["footprint"]
    assert fp["blocks_workload"] == 3 * per_user and fp["extra_blocks"] >= 0
    mem = full["vllm_memory"]
    assert mem["available_kv_cache_gib"] == 0.5 and mem["cudagraph_profile"] == {"FULL": [3.0, 7, 1.0]}
    assert mem["worker_bytes"] == {"weights": 5, "peak_activation": 1, "non_torch": 2, "cudagraph_estimate": 3,
                                   "available_kv_cache": 4}
    ks = full["kvrepro_settings"]   # the settings object every layer of the engine uses, plus what they resolved
    assert {k: ks[k] for k in ("preset", "decode_impl_setting", "num_splits", "prefill", "store_rotate", "warmup",
                               "debug_check")} == {"preset": "k4v4", "decode_impl_setting": "auto", "num_splits": None,
                                                   "prefill": "fa", "store_rotate": "kernel", "warmup": True,
                                                   "debug_check": False}
    assert ks["decode_impl"] == "auto (no layer resolved it yet)"   # the simulated engine builds no layer
    from kvrepro.ops import decode as dec
    from kvrepro.provenance import src_sha256
    from kvrepro.vllm_backend.runtime import settings_record
    assert ks["decode_dequant"] == dec.default_dequant(torch.device("cuda")) == "asm"
    assert (ks["decode_block_n"], ks["decode_num_warps"]) == dec.default_launch(4, "int8") == (256, 4)
    assert ks["decode_key_mma"] == dec.DEFAULT_KEY_MMA == "int8"  # k4v4, the default preset
    assert ks["kvrepro_src_sha256"] == full["kvrepro_src_sha256"] == src_sha256() and len(src_sha256()) == 64
    assert all(r["kvrepro_settings"] == ks for r in rows)  # every row of the mode, edge and abort windows too
    assert settings_record("asm")["decode_dequant"] == "asm"
    with pytest.raises(ValueError, match="dequant"):
        settings_record("ptx")
    ids = {r["engine_run_id"] for r in rows}   # one engine run, named in every row
    assert len(ids) == 1 and len(ids.pop()) == 32
    edge = by[("edge-check", 4)]
    assert not edge["clean"] and edge["edge_outcome"] in ("waiting", "preempted")
    assert edge["free_blocks_at_edge"] < per_user  # why: fewer free blocks than one user needs
    assert [r["num_users"] for r in rows if r["measured_by"] == "abort-window"] == [2, 1]
    assert all(r["clean"] for r in rows if r["measured_by"] == "abort-window")
    assert len(sweep.ResultsFile(path).rows) == len(rows) == 4
    # margin covers the abort windows and the edge check for every mode alike
    assert full["max_model_len"] == prompt + decode + window * 8 + 64 + worker.EDGE_STEPS


def test_measure_mode_sees_preemption_when_the_pool_is_smaller_than_vllm_reported(tmp_path, monkeypatch):
    """If the engine really has fewer blocks than the arithmetic assumed, the full row is not clean."""
    prompt, decode = 4096, 64
    per_user = math.ceil((prompt + decode) / BS)
    mods = fake_vllm(3 * per_user + 1)
    real_init = mods["vllm"].LLM.__init__

    def smaller(self, **kw):
        real_init(self, **kw)
        self.core.free -= 8  # 8 blocks fewer than reported: the three users cannot all finish
    mods["vllm"].LLM.__init__ = smaller
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: NS(total_memory=160 * 2**30))
    rows = worker.measure_mode("bf16", str(tmp_path / "p.jsonl"), "p", prompt_tokens=prompt,
                                decode_tokens=decode, window_steps=2, max_users=8, timeout_s=20, block_size=BS)
    full = rows[0]
    assert full["measured_by"] == "full" and full["num_users"] == 3
    assert not full["clean"] and full["preemptions"] > 0
    assert all(not r["clean"] for r in rows)  # windows inherit the full row's verdict


def test_edge_check_is_skipped_when_max_users_caps_n(tmp_path, monkeypatch, capsys):
    prompt, decode = 4096, 64
    for name, m in fake_vllm(3 * math.ceil((prompt + decode) / BS) + 5).items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: NS(total_memory=160 * 2**30))
    rows = worker.measure_mode("fp8", str(tmp_path / "c.jsonl"), "c", prompt_tokens=prompt, decode_tokens=decode,
                                window_steps=2, max_users=2, confirm_edge=True, timeout_s=120, block_size=BS)
    assert [(r["measured_by"], r["num_users"]) for r in rows] == [("full", 2), ("abort-window", 1)]
    assert "edge check skipped" in capsys.readouterr().out
    # a full row capped by max_users needs no edge row to count as complete, even when the edge check was asked
    assert sweep.mode_status(rows, "fp8", confirm_edge=True) == (True, "")


def _simulate(monkeypatch, num_blocks):
    for name, m in fake_vllm(num_blocks).items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: NS(total_memory=160 * 2**30))


def test_resume_after_a_killed_worker_measures_the_mode_again_from_one_engine_run(tmp_path, monkeypatch, capsys):
    """The fault: a worker killed after the full window and one abort window left a mode whose full row existed;
    the resumed sweep counted it as done (abort windows never measured), or a re-measurement skipped the rows the
    file already had and mixed two engine runs. Now the resume supersedes the partial rows and measures the mode
    again; the file ends with one engine run's complete rows."""
    prompt, decode = 4096, 64
    per_user = math.ceil((prompt + decode) / BS)
    _simulate(monkeypatch, 3 * per_user + 5)                       # 3 users fit: abort windows 2 and 1
    params = {"prompt_tokens": prompt, "decode_tokens": decode, "window_steps": 2, "max_users": 8, "block_size": BS}
    path = tmp_path / "r.jsonl"
    real_abort, aborts = worker.Runner.abort, []

    def killed_at_second_window(self, rids):
        aborts.append(rids)
        if len(aborts) == 2:                                       # the process dies before window 1
            raise KeyboardInterrupt("killed")
        real_abort(self, rids)

    monkeypatch.setattr(worker.Runner, "abort", killed_at_second_window)
    with pytest.raises(KeyboardInterrupt):
        worker.measure_mode("kvrepro:k4v4", str(path), "r", **params)
    partial = sweep.ResultsFile(path).rows
    assert [(r["measured_by"], r["num_users"]) for r in partial] == [("full", 3), ("abort-window", 2)]
    assert sweep.mode_status(partial, "kvrepro:k4v4") == (False, "abort windows 1 of N=3 missing")
    monkeypatch.setattr(worker.Runner, "abort", real_abort)

    spawned = []

    def run_worker_here(cmd):   # the worker subprocess, in this process (same argv)
        assert cmd[1:3] == ["-m", "kvrepro.sweep_worker"]
        spawned.append(cmd[cmd.index("--mode") + 1])
        assert sweep.ResultsFile(path).engine_runs(spawned[-1]) == []   # superseded before the worker starts
        return worker.main(cmd[3:])

    import subprocess

    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", run_worker_here)
    capsys.readouterr()
    assert sweep.run_sweep(["kvrepro:k4v4"], path, "r", params) == ["kvrepro:k4v4"]
    out = capsys.readouterr().out
    assert (f"[sweep] kvrepro:k4v4: 2 earlier rows (engine run {partial[0]['engine_run_id']}) superseded: abort "
            f"windows 1 of N=3 missing; moved to {tmp_path / 'r.jsonl.superseded'}") in out
    rows = sweep.ResultsFile(path).rows
    assert [(r["measured_by"], r["num_users"]) for r in rows] == [("full", 3), ("abort-window", 2), ("abort-window", 1)]
    assert len({r["engine_run_id"] for r in rows}) == 1 and rows[0]["engine_run_id"] != partial[0]["engine_run_id"]
    old = [json.loads(x) for x in (tmp_path / "r.jsonl.superseded").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("superseded", "superseded_date")} for r in old] == partial
    assert all(r["superseded"] == "incomplete: abort windows 1 of N=3 missing; measured again" for r in old)
    assert sweep.run_sweep(["kvrepro:k4v4"], path, "r", params) == [] and spawned == ["kvrepro:k4v4"]
    assert "kvrepro:k4v4: already in" in capsys.readouterr().out


def test_worker_refuses_a_file_that_already_holds_its_mode(tmp_path, monkeypatch):
    """Before vLLM starts: measuring a mode into a file that holds rows of it would mix two engine runs."""
    _simulate(monkeypatch, 600)
    path = tmp_path / "r.jsonl"
    rows = worker.measure_mode("fp8", str(path), "r", prompt_tokens=4096, decode_tokens=64, window_steps=2,
                               max_users=2, timeout_s=60, block_size=BS)
    monkeypatch.setattr(sys.modules["vllm"], "LLM", None)          # would fail if the engine were started
    with pytest.raises(ValueError, match=f"already holds {len(rows)} fp8 rows; measuring it again here would mix "
                                         "two engine runs"):
        worker.measure_mode("fp8", str(path), "r", prompt_tokens=4096, decode_tokens=64, block_size=BS)
