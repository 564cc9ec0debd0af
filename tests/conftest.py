"""Shared pytest setup: environment before torch loads, and the markers that gate hardware.

Markers (declared in ``pyproject.toml``):

- ``gpu``: needs a CUDA device; skipped with that reason where ``torch.cuda.is_available()`` is False.
  ``make test-gpu`` (``pytest -m gpu``) runs exactly these on a GPU machine.
- ``vllm``: needs vLLM 0.20.2 importable; skipped with that reason where it is not.
- ``slow``: more than ~30 s on the 2-core CPU machine; run by ``make test``, left out by ``-m "not slow"``.

Why the environment is set here: OpenMP threads wait passively (spinning threads slowed CPU model runs
10-30x on a busy 2-core machine), and without CUDA the Triton kernels run in Triton's interpreter; both
must be set before torch / triton are imported.
"""
import collections
import importlib.util
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SKIP_REASONS = {
    "gpu": None if HAS_CUDA else "needs a CUDA GPU (torch.cuda.is_available() is False); run `make test-gpu` on one",
    "vllm": None if HAS_VLLM else "needs vLLM 0.20.2 (not installed; GPU path: conda env from environment.yml)",
}


NOTEBOOK_KERNEL = "kvrepro-pytest"


@pytest.fixture(scope="session")
def notebook_kernel(tmp_path_factory):
    """The name of a kernelspec that runs this very interpreter, first on JUPYTER_PATH, so that no user-level
    'python3' kernel runs the notebooks with another Python (tests that execute notebooks through papermill)."""
    d = tmp_path_factory.mktemp("jupyter")
    spec = d / "kernels" / NOTEBOOK_KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": NOTEBOOK_KERNEL, "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(d) + (os.pathsep + old if old else "")
    yield NOTEBOOK_KERNEL
    if old is None:
        os.environ.pop("JUPYTER_PATH")
    else:
        os.environ["JUPYTER_PATH"] = old


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` / ``vllm`` tests, with the reason, where the machine lacks what they need."""
    for item in items:
        for name, reason in SKIP_REASONS.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, so a run says why tests did not run (``-rs`` lists each)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for rep in skipped:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    terminalreporter.section("skip reasons")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"{n:4d} skipped: {reason}")


RaggedBatch = collections.namedtuple("RaggedBatch", "pool block_tables seq_lens max_blocks kv")


@pytest.fixture
def ragged_batch():
    """``build(preset, lens, num_kv_heads, head_dim, gen, *, block_size=16, dtype=torch.bfloat16, high=True,
    spare_blocks=5)``: a poisoned pool (``test_ops_helpers.make_pool``) of ``len(lens) * max_blocks + spare_blocks``
    blocks, ``max_blocks`` = the longest sequence's blocks + 1, with random K/V of ``lens[b]`` tokens stored
    (``store_kv``) for each row (a 0 is a padding row: nothing stored); block ids distinct, from the top of the pool
    with ``high``. Returns ``RaggedBatch(pool, block_tables [B, max_blocks] int32, seq_lens [B] int32, max_blocks,
    kv)`` with ``kv[b]`` the ``(k, v)`` ``[lens[b], Hkv, D]`` stored for row ``b`` (None for a padding row). Shared by
    the CUDA decode, carveout and per-model GPU tests."""
    from test_ops_helpers import DEV, block_tables, fill, make_pool

    def build(preset, lens, num_kv_heads, head_dim, gen, *, block_size=16, dtype=torch.bfloat16, high=True,
              spare_blocks=5):
        maxb = max(-(-max(n, 1) // block_size) for n in lens) + 1
        nb = len(lens) * maxb + spare_blocks
        pool = make_pool(preset, num_kv_heads, head_dim, block_size, nb, gen)
        bt = block_tables(len(lens), maxb, nb, gen, high=high)
        kv = [fill(pool, bt[b], n, gen, dtype) if n else None for b, n in enumerate(lens)]
        return RaggedBatch(pool, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), maxb, kv)
    return build
