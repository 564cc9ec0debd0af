"""GPU tests written for the fused kernel (run 27: 62 passed on the H200); they import names that only exist
with prototypes/cuda_fused_merge/cuda_decode_launch.diff applied. Kept for the record, not collected."""
)


def test_rotation_signs_accepts_only_the_hadamard_form():
    """The fused kernel applies the rotation as a Walsh-Hadamard transform with signs: rotation_signs returns those
    signs for kvrepro's rotation (any seed) and refuses any other orthogonal matrix (runs on the CPU)."""
    from kvrepro.formats.hadamard import rotation_matrix, rotation_signs

    for seed in (0, 3):
        r = rotation_matrix(128, seed)
        assert torch.equal(cuda_decode.rotation_signs(r), rotation_signs(128, seed))
        assert cuda_decode.rotation_signs(r) is cuda_decode.rotation_signs(r)        # checked once, then cached
    other = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)))[0].float().contiguous()
    with pytest.raises(ValueError, match="rotation must be diag\\(s\\) H / sqrt\\(head_dim\\)"):
        cuda_decode.rotation_signs(other)
    r = rotation_matrix(128, 0).clone()
    cuda_decode.rotation_signs(r)
    r[3, 5] += 0.01                                              # changed in place: checked again, refused
    with pytest.raises(ValueError, match="Sylvester Hadamard"):
        cuda_decode.rotation_signs(r)


@needs_cuda
def test_cuda_strided_query_and_output_and_mixed_dtypes():
    """The kernel reads the query and writes the output through their strides (a slice of a wider buffer, as vLLM's
    [tokens, heads * head_dim] views), in float16 or bfloat16 independently, and leaves the rest of the buffer alone."""
    gen = torch.Generator().manual_seed(9)
    pool, bt = _filled(gen, [190, 77, 16])
    sl = torch.tensor([190, 77, 16], dtype=torch.int32, device=DEV)
    ref = None
    for qd, od in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        wide = torch.randn(3, 40, 128, generator=gen).to(DEV, qd)
        q = wide[:, 4:36]                                           # strides (5120, 128, 1)
        assert not q.is_contiguous()
        obuf = torch.full((5, 34, 128), 7.0, device=DEV, dtype=od)
        out = obuf[1:4, 2:]
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=out, impl="cuda")
        ref = paged_attention_ref(q.contiguous(), pool, bt, sl, torch.arange(4, device=DEV), 128 ** -0.5,
                                  torch.float64)
        assert relerr(out, ref) < (5e-4 if qd == torch.float16 else 4e-3) + (4e-3 if od == torch.bfloat16 else 5e-4)
        untouched = torch.ones(5, 34, dtype=torch.bool, device=DEV)
        untouched[1:4, 2:] = False
        assert (obuf[untouched] == 7.0).all()


@needs_cuda
def test_cuda_split_counters_return_to_zero_and_calls_repeat_exactly():
    """The last CTA of each (sequence, KV head) merges and resets its arrival counter: after any launch the counters
    are zero again, so back-to-back launches (and graph replays) give bit-identical outputs, at every split count."""
    gen = torch.Generator().manual_seed(10)
    lens = [170, 1, 0]                                          # _filled holds up to 3 rows of <= 192 tokens
    pool, bt = _filled(gen, lens)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(4, device=DEV), 128 ** -0.5, torch.float64)
    live = sl > 0
    for s in (1, 2, 7, 22, 64):
        outs = [decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=s,
                                 impl="cuda") for _ in range(3)]
        torch.cuda.synchronize()
        assert (cuda_decode.split_counters(DEV, 32) == 0).all(), s
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]), s
        assert relerr(outs[0][live], ref[live]) < 4e-3 and (outs[0][~live] == 0).all(), s


@needs_cuda
def test_cuda_unchecked_rotation_refused_during_capture(monkeypatch):
    """A rotation tensor never seen eagerly cannot be checked inside graph capture (the check syncs): refused with
    a message that says to run it once eagerly; one seen before is served from the cache."""
    from kvrepro.formats.hadamard import rotation_matrix

    seen = rotation_matrix(128, 0, DEV).clone()
    cuda_decode.rotation_signs(seen)
    fresh = rotation_matrix(128, 0, DEV).clone()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cuda_decode.rotation_signs(seen).device == seen.device
    with pytest.raises(RuntimeError, match="run decode_attention once eagerly"):
        cuda_decode.rotation_signs(fresh)


@needs_cuda
def test_cuda_refuses_more_splits_than_its_merge_holds():
    """impl='cuda' merges in the kernel, holding num_splits x group weights in shared memory: more is refused with
    the limit named."""
    pool = get_format("k4v4").new_pool(4, 8, 128, 16, device=DEV)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16, device=DEV)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    sl = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"num_splits must be <= 2048 \(8192 // GQA group 4\) for impl='cuda'"):
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=2049, impl="cuda")
