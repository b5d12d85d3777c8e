"""GPU tier: the Triton kernels against their torch references in bf16 at decode and
prefill shapes of an 8B-shaped model, several adapters of mixed ranks. Runs on the H200
through the device tool (scripts/gpu-numerics.sh); there is no GPU on the CI machine.

Writes the max errors to $LORAPLANE_GPU_REPORT (JSON) when set.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: run scripts/gpu-numerics.sh through the device tool",
    ),
]

RESULTS: dict[str, dict[str, float]] = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.float() - b.float()).abs()
    return float(diff.max()), float(diff.norm() / b.float().norm().clamp_min(1e-12))


def _batch(tokens: int, slots: int, ranks: list[int], device: str):
    from loraplane.worker.lora.batch_info import LoRABatchInfo

    g = torch.Generator().manual_seed(tokens * 7 + slots)
    token_slots = torch.randint(-1, slots, (tokens,), generator=g).tolist()
    slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
    scalings = torch.tensor([2.0 / r for r in ranks], dtype=torch.float32, device=device)
    return LoRABatchInfo.build(token_slots, slot_ranks, scalings, device)


@pytest.mark.parametrize("tokens", [16, 128, 2048])
@pytest.mark.parametrize(
    ("name", "k", "sizes"),
    [("qkv", 4096, [4096, 1024, 1024]), ("gate_up", 4096, [14336, 14336]), ("down", 14336, [4096])],
)
def test_dense_kernels_bf16(tokens: int, name: str, k: int, sizes: list[int]) -> None:
    from loraplane.worker.kernels import expand, reference, shrink

    dev, r_max, ranks = "cuda", 64, [16, 64, 8, 32]
    info = _batch(tokens, len(ranks), ranks, dev)
    assert info is not None
    n = len(sizes)
    offsets = torch.tensor(
        [0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    a = torch.randn(len(ranks), n * r_max, k, device=dev, dtype=torch.bfloat16) / k**0.5
    b = (
        torch.randn(len(ranks), int(offsets[-1]), r_max, device=dev, dtype=torch.bfloat16)
        / r_max**0.5
    )
    args = (info.seg_indptr, info.seg_slots, info.slot_ranks, info.row_order, n, info.max_seg_len)
    y = shrink.lora_shrink(x, a, *args)
    y_ref = reference.lora_shrink(x, a, *args)
    out = torch.randn(tokens, int(offsets[-1]), device=dev, dtype=torch.bfloat16)
    out_ref = out.clone()
    eargs = (
        info.seg_indptr,
        info.seg_slots,
        info.slot_ranks,
        info.slot_scalings,
        info.row_order,
        offsets,
    )
    expand.lora_expand(y_ref, b, *eargs, out, info.max_seg_len)
    reference.lora_expand(y_ref, b, *eargs, out_ref, info.max_seg_len)
    s_max, s_rel = _rel(y, y_ref)
    e_max, e_rel = _rel(out, out_ref)
    RESULTS[f"{name}-T{tokens}"] = {
        "shrink_max_abs": s_max,
        "shrink_rel": s_rel,
        "expand_max_abs": e_max,
        "expand_rel": e_rel,
    }
    assert s_rel < 1e-2 and e_rel < 1e-2


@pytest.mark.parametrize("tokens", [64, 2048])
def test_fp32_lora_apply_fits_in_shared_memory(tokens: int) -> None:
    """fp32 at rank 64 and K = 4096 once asked for 256 KB of shared memory (the H200 has
    227 KB) and failed to launch; the shrink's K step now shrinks with the element size."""
    from loraplane.worker.kernels import expand, reference

    dev, r_max, ranks, k, n_out = "cuda", 64, [64, 16], 4096, 4096
    info = _batch(tokens, len(ranks), ranks, dev)
    assert info is not None
    offsets = torch.tensor([0, n_out], dtype=torch.int32, device=dev)
    x = torch.randn(tokens, k, device=dev)
    a = torch.randn(len(ranks), r_max, k, device=dev) / k**0.5
    b = torch.randn(len(ranks), n_out, r_max, device=dev) / r_max**0.5
    out = torch.randn(tokens, n_out, device=dev)
    out_ref = out.clone()
    seg = (info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings, info.row_order)
    expand.lora_apply(x, a, b, *seg, offsets, out, info.max_seg_len)
    y = reference.lora_shrink(x, a, *seg[:3], info.row_order, 1, info.max_seg_len)
    reference.lora_expand(y, b, *seg, offsets, out_ref, info.max_seg_len)
    max_abs, rel = _rel(out, out_ref)
    RESULTS[f"fp32-apply-T{tokens}"] = {"max_abs": max_abs, "rel": rel}
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("tokens", "k"), [(16, 4096), (64, 14336)])
def test_split_k_shrink_fix_up_is_exact_over_many_launches(tokens: int, k: int) -> None:
    """At decode the shrink's last program per tile sums the other programs' fp32 partials.

    If a partial were read before it is visible, or a count were left behind, some launch
    would differ. Two inputs alternate (so a stale partial or a stale ``y`` holds the other
    input's values), the graph's output is filled with NaN before each replay, and 300
    launches, eager and replayed, must each give the bits of their input's first launch,
    match the reference, and leave every count zero."""
    from loraplane.worker.kernels import expand, reference, shrink

    dev, ranks = "cuda", [16, 16, 8, 16]
    info = _batch(tokens, len(ranks), ranks, dev)
    assert info is not None
    config = shrink.shrink_config(info.max_seg_len, 16, k, 2)
    tiles = -(-info.max_seg_len // config.block_s) * info.num_segments * 3
    assert shrink.split_k_for(tiles, k, config.block_k) > 1, "K must split, or this tests nothing"
    offsets = torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32, device=dev)
    inputs = [torch.randn(tokens, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    x = inputs[0].clone()  # the static input the graph reads
    a = torch.randn(len(ranks), 3 * 16, k, device=dev, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(len(ranks), 6144, 16, device=dev, dtype=torch.bfloat16)
    seg = (info.seg_indptr, info.seg_slots, info.slot_ranks, info.slot_scalings, info.row_order)
    rank_of = info.slot_ranks[info.seg_slots.long()].repeat_interleave(
        info.seg_indptr.diff().long()
    )  # [positions]: each segment position's rank
    rows = (rank_of > 0).nonzero().flatten()  # the positions the shrink writes
    assert rows.numel() > 0

    def run() -> torch.Tensor:
        return expand.lora_apply_shrink(x, a, b, *seg, offsets, info.max_seg_len).y

    firsts = []
    for xi in inputs:
        x.copy_(xi)
        firsts.append(run()[rows].clone())
    assert not torch.equal(firsts[0], firsts[1])
    bad = 0
    for i in range(200):
        x.copy_(inputs[i % 2])
        bad += int(not torch.equal(run()[rows], firsts[i % 2]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for i in range(100):
        x.copy_(inputs[i % 2])
        captured.fill_(float("nan"))
        graph.replay()
        bad += int(not torch.equal(captured[rows], firsts[i % 2]))
    torch.cuda.synchronize()
    assert bad == 0, f"{bad} of 300 launches differ from their input's first"
    for counts in shrink._counts.values():
        assert not counts.any(), "a launch left fix-up counts behind"
    y_ref = reference.lora_shrink(inputs[1], a, *seg[:3], info.row_order, 3, info.max_seg_len)
    max_abs, rel = _rel(firsts[1], y_ref[rows])
    RESULTS[f"split-k-fixup-T{tokens}-K{k}"] = {"max_abs": max_abs, "rel": rel}
    assert rel < 1e-2


@pytest.mark.parametrize("tokens", [16, 512])
def test_moe_kernels_bf16(tokens: int) -> None:
    from loraplane.worker.kernels import moe, reference

    dev, e, topk, h, inter, r_max, ranks = "cuda", 128, 8, 2048, 768, 16, [16, 8, 16, 4]
    g = torch.Generator().manual_seed(tokens)
    pairs = tokens * topk
    pair_expert = torch.randint(0, e, (pairs,), generator=g).to(torch.int32).to(dev)
    pair_slot = (
        torch.randint(-1, len(ranks), (tokens,), generator=g)
        .repeat_interleave(topk)
        .to(torch.int32)
        .to(dev)
    )
    slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scalings = torch.tensor([2.0 / r for r in ranks], dtype=torch.float32, device=dev)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    a = torch.randn(len(ranks), e, 2 * r_max, h, device=dev, dtype=torch.bfloat16) / h**0.5
    b = torch.randn(len(ranks), e, 2 * inter, r_max, device=dev, dtype=torch.bfloat16) / r_max**0.5
    offsets = torch.tensor([0, inter, 2 * inter], dtype=torch.int32, device=dev)
    routing = moe.moe_lora_routing(pair_expert, pair_slot, len(ranks), e)
    y = moe.moe_lora_shrink(x, a, pair_expert, pair_slot, slot_ranks, 2, topk=topk, routing=routing)
    y_ref = reference.moe_lora_shrink(x, a, pair_expert, pair_slot, slot_ranks, 2, topk=topk)
    out = torch.randn(pairs, 2 * inter, device=dev, dtype=torch.bfloat16)
    out_ref = out.clone()
    moe.moe_lora_expand(
        y_ref, b, pair_expert, pair_slot, slot_ranks, scalings, offsets, out, routing=routing
    )
    reference.moe_lora_expand(
        y_ref, b, pair_expert, pair_slot, slot_ranks, scalings, offsets, out_ref
    )
    s_max, s_rel = _rel(y, y_ref)
    e_max, e_rel = _rel(out, out_ref)
    RESULTS[f"moe-gate_up-T{tokens}"] = {
        "shrink_max_abs": s_max,
        "shrink_rel": s_rel,
        "expand_max_abs": e_max,
        "expand_rel": e_rel,
    }
    assert s_rel < 1e-2 and e_rel < 1e-2


@pytest.mark.parametrize("tokens", [16, 128, 2048])
def test_expert_grouped_matmul_bf16(tokens: int) -> None:
    """The base experts' device-routed grouped GEMM (Qwen3-30B-A3B gate_up and down shapes)."""
    from loraplane.worker.kernels import experts

    dev, e, topk, h, inter = "cuda", 128, 8, 2048, 768
    g = torch.Generator().manual_seed(tokens + 1)
    pair_expert = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    pair_expert = pair_expert.flatten().to(torch.int32).to(dev)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    w_gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) / h**0.5
    w_down = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) / inter**0.5
    routing = experts.moe_expert_routing(pair_expert, e)
    gu = experts.moe_grouped_matmul(x, w_gate_up, routing, x_row_div=topk)
    act = gu[:, :inter]
    d = experts.moe_grouped_matmul(act.contiguous(), w_down, routing)
    xp = x.float().repeat_interleave(topk, dim=0)
    gu_ref = torch.empty(xp.shape[0], 2 * inter, device=dev)
    d_ref = torch.empty(xp.shape[0], h, device=dev)
    for expert in pair_expert.unique().tolist():  # one fp32 matmul per expert present
        sel = pair_expert == expert
        gu_ref[sel] = xp[sel] @ w_gate_up[expert].float().t()
        d_ref[sel] = act[sel].float() @ w_down[expert].float().t()
    g_max, g_rel = _rel(gu, gu_ref)
    d_max, d_rel = _rel(d, d_ref)
    RESULTS[f"experts-T{tokens}"] = {
        "gate_up_max_abs": g_max,
        "gate_up_rel": g_rel,
        "down_max_abs": d_max,
        "down_rel": d_rel,
    }
    assert g_rel < 1e-2 and d_rel < 1e-2


@pytest.mark.parametrize(("tokens", "adapters"), [(16, 1), (128, 1), (128, 8)])
def test_experts_lora_inside_the_base_kernels_bf16(tokens: int, adapters: int) -> None:
    """``moe_experts_lora`` at Qwen3-30B-A3B shapes (128 experts, top-8, rank 16 and lower
    ranks): against fp64 references; pairs without an adapter equal the base kernels. Told
    of many adapters, gate_up's shrink is split over two programs per tile: the same bits."""
    import dataclasses

    from tests.kernels.test_expert_kernels import experts_lora_reference, lora_case

    from loraplane.worker.kernels import experts, swiglu

    x, w_gate_up, w_down, pair_expert, lora = lora_case(
        tokens, 8, 128, (16, 8, 16, 4), torch.bfloat16, hidden=2048, inter=768
    )
    routing = experts.moe_expert_routing(pair_expert, 128)
    d, delta = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, lora)
    if adapters > 1:
        assert experts.shrink_split(adapters) > 1
        many = dataclasses.replace(lora, adapters=adapters)
        split = experts.moe_experts_lora(x, w_gate_up, w_down, pair_expert, routing, many)
        assert torch.equal(split[0], d) and torch.equal(split[1], delta)
    want = experts_lora_reference(x, w_gate_up, w_down, pair_expert, lora)
    max_abs, rel = _rel(d.double() + delta.double(), want)
    base = experts.moe_grouped_matmul(
        swiglu.silu_and_mul(experts.moe_grouped_matmul(x, w_gate_up, routing, x_row_div=8)),
        w_down,
        routing,
    )
    without = lora.token_slots.repeat_interleave(8) < 0
    RESULTS[f"experts-lora-T{tokens}-a{adapters}"] = {"max_abs": max_abs, "rel": rel}
    assert rel < 1e-2
    assert without.any() and torch.equal(d[without], base[without])
    assert not delta[without].any() and delta[~without].abs().max() > 0


@pytest.mark.parametrize("tokens", [16, 128])
def test_overlapped_lora_matches_serial_eager_and_in_a_graph(tokens: int) -> None:
    """The shrink on a side stream during the base GEMM gives the serial result bit for bit."""
    from loraplane.worker.lora.backend import LoRABackend

    dev, k, sizes, ranks = "cuda", 4096, [4096, 1024, 1024], [16, 16, 8, 16]
    info = _batch(tokens, len(ranks), ranks, dev)
    assert info is not None
    offsets = torch.tensor([0, 4096, 5120, 6144], dtype=torch.int32, device=dev)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(sum(sizes), k, device=dev, dtype=torch.bfloat16) / k**0.5
    a = torch.randn(len(ranks), 3 * 16, k, device=dev, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(len(ranks), sum(sizes), 16, device=dev, dtype=torch.bfloat16) / 4

    def base(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(t, w)

    serial = LoRABackend("triton", overlap="off").apply_around(x, base, a, b, info, offsets)
    eager = LoRABackend("triton", overlap="on").apply_around(x, base, a, b, info, offsets)
    auto = LoRABackend("triton")  # "auto": overlaps while a graph is captured
    auto.apply_around(x, base, a, b, info, offsets)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = auto.apply_around(x, base, a, b, info, offsets)
    x.copy_(torch.randn_like(x))
    graph.replay()
    replayed_serial = LoRABackend("triton", overlap="off").apply_around(
        x, base, a, b, info, offsets
    )
    torch.cuda.synchronize()
    assert torch.equal(eager, serial)
    assert torch.equal(captured, replayed_serial)
    assert not torch.equal(serial, replayed_serial)  # the replay saw the new x


@pytest.mark.parametrize(("tokens", "max_ctx"), [(16, 512), (128, 2048), (4, 8192)])
def test_decode_attention_bf16(tokens: int, max_ctx: int) -> None:
    """In-place decode attention at Llama-3-8B's heads (32 q, 8 kv, d 128) vs gathered SDPA:
    5 splits over up to 2 chunks of 256 positions, one split, 16 splits of up to 2 chunks
    each."""
    import torch.nn.functional as F

    from loraplane.worker.kernels import attention

    dev, heads, kv, d = "cuda", 32, 8, 128
    g = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(tokens + 4, max_ctx, kv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(tokens + 4, max_ctx, kv, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(tokens, heads, d, device=dev, dtype=torch.bfloat16)
    rows = torch.randperm(tokens + 4, generator=g)[:tokens].to(dev)
    lens = torch.randint(1, max_ctx + 1, (tokens,), generator=g).to(dev)
    table = torch.arange(tokens + 4, device=dev, dtype=torch.int32)[:, None]  # a page a row
    out = attention.decode_attention(q, k_cache, v_cache, table, rows, lens, d**-0.5)
    ref = torch.empty(tokens, heads, d, device=dev)
    for t in range(tokens):
        n = int(lens[t])
        keys = k_cache[rows[t], :n].float().transpose(0, 1)[None]
        values = v_cache[rows[t], :n].float().transpose(0, 1)[None]
        ref[t] = F.scaled_dot_product_attention(
            q[t].float()[None, :, None, :], keys, values, scale=d**-0.5, enable_gqa=True
        )[0, :, 0, :]
    a_max, a_rel = _rel(out, ref)
    RESULTS[f"decode_attention-T{tokens}-L{max_ctx}"] = {"max_abs": a_max, "rel": a_rel}
    assert a_rel < 1e-2


@pytest.mark.parametrize(("prefix", "new", "chunks"), [(1024, 64, 16), (0, 200, 3), (37, 500, 2)])
def test_extend_attention_bf16(prefix: int, new: int, chunks: int) -> None:
    """Prompt chunks in one launch at Llama-3-8B's heads over pages of 16 scattered over the
    pool, beside decode rows it leaves alone, vs fp32 SDPA per chunk over the gathered row:
    the shared-prefix serve load's step (64 new tokens past 1024), chunks from 0 over
    several tiles, chunks past a prefix that is not a multiple of a page or a block."""
    import torch.nn.functional as F

    from loraplane.worker.kernels import attention
    from loraplane.worker.models.batch import PROMPT_TILE, ForwardBatch, SeqChunk

    dev, heads, kv, d, page = "cuda", 32, 8, 128, 16
    g = torch.Generator().manual_seed(prefix + new)
    per_row = -(-(prefix + new) // page)
    pool = (chunks + 2) * per_row
    order = torch.randperm(pool, generator=g).tolist()
    table = torch.tensor(order, dtype=torch.int32, device=dev).view(chunks + 2, per_row)
    k_cache = torch.randn(pool, page, kv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(pool, page, kv, d, device=dev, dtype=torch.bfloat16)
    layout = [SeqChunk(r, prefix, new, r * (new + 1)) for r in range(chunks)]
    layout += [SeqChunk(chunks + r % 2, 5, 1, r * (new + 1) + new) for r in range(chunks)]
    layout.sort(key=lambda c: c.token_offset)
    tokens = chunks * (new + 1)
    batch = ForwardBatch.from_chunks(
        [[0] * c.length for c in layout], layout, all_logits=False, device=dev
    )
    q = torch.randn(tokens, heads, d, device=dev, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    tiles = batch.prompt_tiles(torch.device(dev), PROMPT_TILE)
    attention.extend_attention(q, k_cache, v_cache, table, tiles, d**-0.5, out, block_m=PROMPT_TILE)
    total = prefix + new
    mask = (
        torch.arange(total, device=dev)[None, :] <= torch.arange(prefix, total, device=dev)[:, None]
    )
    ref = torch.zeros(tokens, heads, d, device=dev)
    for c in layout:
        if c.length < 2:
            continue
        pages = table[c.cache_row].long()
        keys = k_cache[pages].flatten(0, 1)[:total].float().transpose(0, 1)[None]
        values = v_cache[pages].flatten(0, 1)[:total].float().transpose(0, 1)[None]
        qs = q[c.token_offset : c.token_offset + new].float().transpose(0, 1)[None]
        ref[c.token_offset : c.token_offset + new] = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=True
        )[0].transpose(0, 1)
    a_max, a_rel = _rel(out, ref)  # decode rows: zero in both
    RESULTS[f"extend_attention-P{prefix}-N{new}-C{chunks}"] = {"max_abs": a_max, "rel": a_rel}
    assert a_rel < 1e-2


def teardown_module() -> None:
    path = os.environ.get("LORAPLANE_GPU_REPORT")
    if path and RESULTS:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2)


@pytest.mark.parametrize("tokens", [16, 64, 128])
@pytest.mark.parametrize(
    ("name", "k", "sizes"),
    [("qkv", 4096, [4096, 1024, 1024]), ("o", 4096, [4096]), ("gate_up", 4096, [14336, 14336])],
)
def test_stacked_gemm_lora_matches_shrink_and_expand_bf16(
    tokens: int, name: str, k: int, sizes: list[int]
) -> None:
    """A staged batch (stage metadata from ``StaticLoRABatch``, as a graph step builds it):
    the base GEMM over ``[W; A_staged]`` and the fused epilogue give what the shrink and
    expand kernels give, followed by the same residual add or SwiGLU in fp32."""
    from loraplane.worker import kernels
    from loraplane.worker.lora.backend import LoRABackend
    from loraplane.worker.lora.batch_info import LoRABatchInfo, StaticLoRABatch

    dev, r_max, ranks = "cuda", 16, [16, 8, 16, 16]
    g = torch.Generator().manual_seed(tokens)
    slots = torch.randint(-1, len(ranks), (tokens,), generator=g).tolist()
    slots = sorted(slots, key=lambda s: (s < 0, s))  # the engine's order: by slot
    slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scalings = torch.tensor([2.0, 0.5, 1.0, 4.0], device=dev)
    positions = {0: 2, 1: 0, 2: 3, 3: 1}  # slot -> stage position, not in slot order
    static = StaticLoRABatch(tokens, 4, slot_ranks, scalings, torch.device(dev), None, 4, 16)
    static.fill(slots, positions=positions)
    info = static.info()
    assert info.stage is not None and info.stage.width == 4
    n_slices, n = len(sizes), sum(sizes)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    offsets = offsets.to(dev)
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    a = torch.randn(4, n_slices * r_max, k, device=dev, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(4, n, r_max, device=dev, dtype=torch.bfloat16) / 4
    for s, r in enumerate(ranks):  # the slot buffers' layout: zero past the rank
        a[s].view(n_slices, r_max, k)[:, r:] = 0
        b[s, :, r:] = 0
    staged = torch.empty(4, n_slices * r_max, k, device=dev, dtype=torch.bfloat16)
    for s, p in positions.items():
        staged[p] = a[s]
    full = torch.nn.functional.linear(x, torch.cat([w, staged.reshape(-1, k)]))
    n_r = n_slices * r_max

    unfused = torch.nn.functional.linear(x, w)
    plain_info = LoRABatchInfo.build(slots, slot_ranks, scalings, dev)
    assert plain_info is not None
    LoRABackend("triton", overlap="off").apply(x, a, b, plain_info, offsets, unfused)
    if name == "qkv":
        got = kernels.stacked_plain(full, n, n_r, b, info.stage, offsets)
        want = unfused
    elif name == "o":
        residual = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        want = (residual.float() + unfused.float()).to(torch.bfloat16)
        got = kernels.stacked_residual(full, n, n_r, b, info.stage, residual)
    else:
        got = kernels.stacked_silu_mul(full, n, n_r, b, info.stage)
        want = kernels.silu_and_mul(unfused)
    max_abs, rel = _rel(got, want)
    RESULTS[f"stacked-{name}-T{tokens}"] = {"max_abs": max_abs, "rel": rel}
    assert rel < 1e-2
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    if name == "qkv" and base_rows:  # rows without an adapter: the base GEMM's values exactly
        assert torch.equal(got[base_rows], full[base_rows, :n])
