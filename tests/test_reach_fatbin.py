"""The fatbin's provenance per kernel (issue 22): ``cuda_build.cubin_functions`` reads each function's code section
from a cubin, ``fatbin_entries`` records them per SASS entry, and ``kvrepro.reach`` calls a GPU family's CUDA kernels
measured only where the code of each kernel equals the code a committed measurement ran (a fatbin that gained kernels
keeps the claim for the ones it did not change; the added ones are "built, not run"). No GPU, no nvcc."""
import hashlib
import json
import shutil
import struct
import subprocess

import pytest

from kvrepro import reach
from kvrepro.ops import cuda_build, cuda_decode

PLAIN = list(cuda_decode.KERNELS.values())
ROPE = list(cuda_decode.ROPE_KERNELS.values())


def _elf(sections: list[tuple[str, int, bytes]]) -> bytes:
    """A little-endian ELF64 built by hand (ELF gABI): a 64-byte file header, the sections' bytes, a section-name
    table and the section headers (index 0 the null section). ``sections``: (name, sh_type, bytes); a SHT_NOBITS
    section gets a size of len(bytes) and no bytes in the file."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _, _ in sections) + b".shstrtab\0"
    body, heads, at, name_at = b"", [], 64, 1
    for name, kind, data in sections:
        heads.append((name_at, kind, at, len(data)))
        name_at += len(name) + 1
        if kind != cuda_build.SHT_NOBITS:
            body += data
            at += len(data)
    heads.append((name_at, 3, at, len(names)))                  # .shstrtab (SHT_STRTAB)
    body += names
    shoff = 64 + len(body)
    shnum = len(heads) + 1
    hdr = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)               # ELFCLASS64, little-endian, version 1
    hdr += struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, shnum, shnum - 1)
    table = bytes(64) + b"".join(struct.pack("<IIQQQQIIQQ", n, k, 6, 0, o, s, 0, 0, 1, 0) for n, k, o, s in heads)
    return hdr + body + table


CODE_A = bytes(range(200)) * 3
CODE_B = b"\x11\x22\x33\x44" * 40


def test_cubin_functions_hashes_each_code_section_of_a_hand_made_elf():
    elf = _elf([(".nv.info.kvrepro_decode_k4v4", 0x70000000, b"\x04\x2f\x08\x00" * 3),
                (".text.kvrepro_decode_k4v4", 1, CODE_A), (".text._Z3fooPf", 1, CODE_B),
                (".nv.shared.kvrepro_decode_k4v4", cuda_build.SHT_NOBITS, bytes(4096))])
    assert len(elf) < 4096 + 64          # the NOBITS section takes no file bytes
    got = cuda_build.cubin_functions(elf)
    assert got == {"_Z3fooPf": hashlib.sha256(CODE_B).hexdigest(),
                   "kvrepro_decode_k4v4": hashlib.sha256(CODE_A).hexdigest()}
    assert list(got) == sorted(got)
    # another section's bytes changing (the attributes, their symbol indices) leaves the code hash as it was
    other = _elf([(".nv.info.kvrepro_decode_k4v4", 0x70000000, b"\x04\x2f\x09\x00" * 5),
                  (".text.kvrepro_decode_k4v4", 1, CODE_A), (".text._Z3fooPf", 1, CODE_B[:-1] + b"\x45")])
    moved = cuda_build.cubin_functions(other)
    assert moved["kvrepro_decode_k4v4"] == got["kvrepro_decode_k4v4"] and moved["_Z3fooPf"] != got["_Z3fooPf"]


def test_cubin_functions_refuses_what_is_not_an_elf64_it_can_read():
    elf = _elf([(".text.k", 1, CODE_A)])
    with pytest.raises(RuntimeError, match="not a little-endian ELF64"):
        cuda_build.cubin_functions(b"\x7fELF" + bytes([1, 1]) + elf[6:])      # ELFCLASS32
    with pytest.raises(RuntimeError, match="not a little-endian ELF64"):
        cuda_build.cubin_functions(b"(\xb5/\xfd" + elf[4:])                    # a zstd frame (compressed PTX)
    with pytest.raises(RuntimeError, match="section headers out of range"):
        cuda_build.cubin_functions(elf[:-10])
    broken = bytearray(elf)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    struct.pack_into("<Q", broken, shoff + 64 + 24, len(elf))                  # .text.k's offset past the end
    with pytest.raises(RuntimeError, match="section 1 runs past the file"):
        cuda_build.cubin_functions(bytes(broken))


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A fatbin container (``cuda_build.fatbin_entries`` documents it): 16-byte header, then per entry a 64-byte header
    (kind, version, header size, payload size, SM at byte 28) and the payload."""
    body = b""
    for kind, sm, payload in entries:
        head = bytearray(64)
        struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", head, 28, sm)
        body += bytes(head) + payload
    return cuda_build.FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body


def test_fatbin_entries_give_sass_entries_their_kernels(tmp_path):
    cubin = _elf([(".text.kvrepro_decode_k4v4", 1, CODE_A)])
    path = tmp_path / "x.fatbin"
    path.write_bytes(_fatbin([(1, 80, b"ptx text\0"), (2, 90, cubin)]))
    assert cuda_build.fatbin_entries(str(path)) == [
        {"code": "compute_80", "sha256": hashlib.sha256(b"ptx text\0").hexdigest()},
        {"code": "sm_90", "sha256": hashlib.sha256(cubin).hexdigest(),
         "kernels": {"kvrepro_decode_k4v4": hashlib.sha256(CODE_A).hexdigest()}}]
    path.write_bytes(_fatbin([(2, 90, b"\0" * 80)]))
    with pytest.raises(RuntimeError, match=r"the sm_90 entry at byte 16: not a little-endian ELF64"):
        cuda_build.fatbin_entries(str(path))


def _h(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _manifest(entry_sha: str, kernels: dict) -> dict:
    return {"fatbin_sha256": "cur", "entries": [{"code": "sm_90", "sha256": entry_sha, "kernels": kernels}]}


CURRENT = {**{k: _h(k) for k in PLAIN}, **{k: _h(k + "new") for k in ROPE}}
RUN = {"file": "results/x.jsonl", "gpu": "NVIDIA H200", "fatbin_sha256": "old", "date": "2026-12-01",
       "presets": ["k4v2", "k4v4", "k5v4", "k8v4"]}


def _measured(kernels: dict, entry_sha: str = "old-entry", with_kernels: bool = True) -> dict:
    entry = {"code": "sm_90", "sha256": entry_sha} | ({"kernels": kernels} if with_kernels else {})
    return {"fatbins": {"old": {"entries": [entry]}}}


def test_identical_kernel_code_is_measured_and_added_kernels_are_built_not_run():
    """The measured fatbin's sm_90 entry differs as a whole (the rope kernels were added) but each plain kernel's code
    is the same: measured, the rope kernels built and not run."""
    old = {k: _h(k) for k in PLAIN}
    text, used = reach.cuda_status("sm_90", [RUN], _manifest("new-entry", CURRENT), _measured(old))
    assert text == ("**measured** on H200, k4v4 / k8v4 / k4v2 / k5v4 (sm_90 code identical to the runs'; 2026-12-01: "
                    "[x.jsonl](results/x.jsonl)); rope-mean kernels built, not run")
    assert used == [RUN]


def test_a_changed_kernel_is_not_measured():
    old = {k: _h(k) for k in PLAIN} | {"kvrepro_decode_k4v2": _h("k4v2 before a change")}
    text, _ = reach.cuda_status("sm_90", [RUN], _manifest("new-entry", CURRENT), _measured(old))
    assert text.startswith("**measured** on H200, k4v4 / k8v4 / k5v4 (")
    assert text.endswith("; k4v2 not measured; rope-mean kernels built, not run")
    changed = {k: _h(k + "changed") for k in PLAIN}
    text, used = reach.cuda_status("sm_90", [RUN], _manifest("new-entry", CURRENT), _measured(changed))
    assert (text, used) == ("measured with an earlier build; this build's sm_90 not measured", [])


def test_a_kernel_counts_only_where_its_preset_ran():
    """Identical code that no run executed (the run's presets) is not measured: the claim needs both."""
    run = RUN | {"presets": ["k4v4"]}
    text, _ = reach.cuda_status("sm_90", [run], _manifest("new-entry", CURRENT), _measured({k: _h(k) for k in PLAIN}))
    assert text.startswith("**measured** on H200, k4v4 (") and "; k8v4 / k4v2 / k5v4 not measured;" in text
    assert reach.cuda_status("sm_90", [], _manifest("new-entry", CURRENT), _measured({})) is None


def test_an_entry_without_kernel_hashes_counts_only_when_the_whole_entry_is_the_same():
    kernels = {k: _h(k) for k in PLAIN}
    same = reach.cuda_status("sm_90", [RUN], _manifest("e", kernels), _measured({}, "e", with_kernels=False))
    assert same[0].startswith("**measured** on H200, k4v4 / k8v4 / k4v2 / k5v4 (") and "built, not run" not in same[0]
    other = reach.cuda_status("sm_90", [RUN], _manifest("e2", kernels), _measured({}, "e", with_kernels=False))
    assert other[0] == "measured with an earlier build; this build's sm_90 not measured"
    unknown = reach.cuda_status("sm_90", [RUN | {"fatbin_sha256": "never listed"}], _manifest("e", kernels), {})
    assert unknown[0] == "measured with an earlier build; this build's sm_90 not measured"


def test_committed_manifest_records_every_kernel_of_every_sass_entry():
    info = cuda_decode.read_manifest()
    assert info["entries"] == cuda_build.fatbin_entries(cuda_decode.FATBIN)
    for e in info["entries"]:
        if e["code"].startswith("sm_"):
            assert sorted(e["kernels"]) == sorted(cuda_decode.ALL_KERNELS), e["code"]
        else:
            assert "kernels" not in e, e["code"]                 # PTX: no cubin to read
    assert cuda_build.check() == []


def test_check_names_a_kernel_hash_that_is_not_the_fatbins(tmp_path):
    info = cuda_decode.read_manifest()
    entries = json.loads(json.dumps(info["entries"]))
    sm90 = next(e for e in entries if e["code"] == "sm_90")
    sm90["kernels"]["kvrepro_decode_k8v4"] = "0" * 64
    man = tmp_path / "decode.json"
    man.write_text(json.dumps(info | {"entries": entries}))
    problems = cuda_build.check(manifest=str(man))
    assert any("kernel code hashes differ or are missing: sm_90 kvrepro_decode_k8v4" in p for p in problems), problems


def _git_fatbin(commit: str) -> bytes | None:
    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", "show", f"{commit}:kvrepro/ops/cuda/decode.fatbin"], capture_output=True,
                       cwd=reach.repo_root())
    return r.stdout if r.returncode == 0 else None


def test_measured_fatbins_hold_the_code_of_the_fatbins_in_git_history(tmp_path):
    """Each measured fatbin's entries and per-kernel hashes are those ``fatbin_entries`` reads from the fatbin of that
    SHA-256 at its commit; its plain kernels' code equals the committed fatbin's on every SASS target both hold."""
    fatbins = json.loads(reach.MEASURED_FATBINS.read_text())["fatbins"]
    assert set(fatbins) == {"ea200779094fc163cd7f133bdbca2112f04d918d84ca7377188cf595a2aaa90e",
                            "970ceb3112d47cab66b47a927138db2e7e6dfd517fc5f3b2fe654206619af74b",
                            "b2ce9eb7c9f0731ee4f8f884124e8c17a74548d1584e94dc8b8a8fecc33ef7c3",
                            "7ed507566e92541b159e267a2f9cc8b361e4b79367b22927ba5d715583cf7f48",
                            "dd0946a2044af594b8c7778777f4c98b856ac03cc7e7cc0d33c8ad4c25748db4",
                            "2374058f382b89c5852fb0462b3eba7ab3d98fe875c16f1b4e3976cee5e482e7",
                            "7787629efbb8764f558e42f6a7fc0fc6c57426d856721b9e793d14e7b1d9650f",
                            "472f5289ae94156387c13f23cb1e5b0bb94f283a1600b43c4e7e61ec3330ca47"}
    current = {e["code"]: e for e in cuda_decode.read_manifest()["entries"]}
    for sha, rec in fatbins.items():
        for e in rec["entries"]:
            if e["code"].startswith("sm_"):
                # every measured fatbin held the first three presets' kernels; k5v4's came later
                assert set(PLAIN[:3]) <= set(e["kernels"]) <= set(cuda_decode.ALL_KERNELS)
                both = [k for k in PLAIN if k in e["kernels"]]
                assert {k: current[e["code"]]["kernels"][k] for k in both} == {k: e["kernels"][k] for k in both}, \
                    (sha, e["code"])
        data = _git_fatbin(rec["commit"])
        if data is None:
            continue                     # no git history here (a copy of the tree): the hashes above still hold
        assert hashlib.sha256(data).hexdigest() == sha
        path = tmp_path / f"{sha[:8]}.fatbin"
        path.write_bytes(data)
        assert cuda_build.fatbin_entries(str(path)) == rec["entries"]


def test_committed_support_matrix_h200_row_measured_rope_kernels_included():
    """The H200 row: the plain kernels measured by the runs of their fatbin (k5v4's by decode_rope_mean.json and its
    capacity run h200-20261202-k5c), and the rope-mean kernels too since decode_rope_mean.json and the rope-mean
    capacity runs ran their code (no "built, not run" left)."""
    rows = {r["family"]: r for r in reach.gpu_rows()}
    h = rows["H100 / H200"]["status"]
    assert h.startswith("**measured** on H200, k4v4 / k8v4 / k4v2 / k5v4 (sm_90 code identical to the runs'; ")
    for f in ("results/capacity/h200-20261201-w13.jsonl", "benchmarks/results/decode_side_by_side.json",
              "results/capacity/h200-20261202-k5c.jsonl",                # k5v4's kernel: its capacity run
              "results/reach/carveout_splits_h200.json", "results/reach/models_h200.jsonl",
              "benchmarks/results/decode_rope_mean.json", "results/capacity/h200-20261202-rope.jsonl"):
        assert f"({f})" in h
    assert "not run" not in h and "not measured" not in h
    assert rows["A100"]["status"].startswith("built, not run")
    assert all(not r["status"].startswith("**measured**") for fam, r in rows.items() if fam != "H100 / H200")
