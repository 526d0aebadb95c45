"""CPU tests: camera / depth geometry helpers and the FastVGGT merge plan."""
import math

import numpy as np
import pytest
import torch

from visionattn.models.geometry import (closed_form_inverse_se3, confidence_mask, extri_intri_to_pose_encoding,
                                        mat_to_quat, pose_encoding_to_extri_intri, quat_to_mat,
                                        unproject_depth_map_to_point_map)
from visionattn.models.merging import TokenMerging, _destination_mask, plan_merge


def _random_rotations(n, gen):
    q = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    return q / q.norm(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------- geometry
def test_quaternion_round_trip_including_half_turns():
    gen = torch.Generator().manual_seed(0)
    q = _random_rotations(200, gen)
    half_turns = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0.7071, 0.7071, 0, 1e-9]],
                              dtype=torch.float64)
    q = torch.cat([q, half_turns / half_turns.norm(dim=-1, keepdim=True)])
    R = quat_to_mat(q)
    eye = torch.eye(3, dtype=torch.float64).expand_as(R)
    assert torch.allclose(R @ R.transpose(-1, -2), eye, atol=1e-12)
    assert torch.allclose(torch.linalg.det(R), torch.ones(len(q), dtype=torch.float64))
    assert torch.allclose(quat_to_mat(mat_to_quat(R)), R, atol=1e-9)
    # quaternion sign ambiguity: q and -q are the same rotation
    q2 = mat_to_quat(R)
    assert torch.allclose((q2 * q).sum(-1).abs(), torch.ones(len(q), dtype=torch.float64), atol=1e-9)


def test_quat_to_mat_matches_axis_angle():
    """xyzw convention: a rotation of theta about z maps x to (cos, sin, 0)."""
    th = 0.3
    q = torch.tensor([0, 0, math.sin(th / 2), math.cos(th / 2)], dtype=torch.float64)
    R = quat_to_mat(q)
    assert torch.allclose(R[:, 0], torch.tensor([math.cos(th), math.sin(th), 0], dtype=torch.float64))


def test_pose_encoding_round_trip():
    gen = torch.Generator().manual_seed(1)
    B, S, H, W = 2, 3, 294, 518
    R = quat_to_mat(_random_rotations(B * S, gen)).reshape(B, S, 3, 3)
    t = torch.randn(B, S, 3, 1, generator=gen, dtype=torch.float64)
    E = torch.cat([R, t], dim=-1)
    f = 300 + 100 * torch.rand(B, S, generator=gen, dtype=torch.float64)
    K = torch.zeros(B, S, 3, 3, dtype=torch.float64)
    K[..., 0, 0], K[..., 1, 1] = f, f * 1.1
    K[..., 0, 2], K[..., 1, 2], K[..., 2, 2] = W / 2, H / 2, 1
    enc = extri_intri_to_pose_encoding(E, K, (H, W))
    assert enc.shape == (B, S, 9)
    E2, K2 = pose_encoding_to_extri_intri(enc, (H, W))
    assert E2.shape == (B, S, 3, 4) and K2.shape == (B, S, 3, 3)
    assert torch.allclose(E2, E, atol=1e-9) and torch.allclose(K2, K, atol=1e-7)
    # fov_h from fy: 2 atan(H / 2 / fy)
    assert torch.allclose(enc[..., 7], 2 * torch.atan(H / 2 / K[..., 1, 1]))
    with pytest.raises(ValueError, match="9 values"):
        pose_encoding_to_extri_intri(enc[..., :8], (H, W))


def test_unproject_plane():
    """Depth of the world plane z = 4 seen by tilted cameras unprojects back onto that plane."""
    S, H, W = 2, 24, 32
    gen = torch.Generator().manual_seed(2)
    # camera-from-world: small rotations, camera centres near the origin
    ang = [0.1, -0.15]
    E = torch.zeros(S, 3, 4, dtype=torch.float64)
    for i, a in enumerate(ang):
        c, s = math.cos(a), math.sin(a)
        R = torch.tensor([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=torch.float64)
        centre = 0.3 * torch.randn(3, generator=gen, dtype=torch.float64)
        E[i, :, :3], E[i, :, 3] = R, -R @ centre
    K = torch.tensor([[40.0, 0, W / 2], [0, 42.0, H / 2], [0, 0, 1]], dtype=torch.float64).expand(S, 3, 3)
    v, u = torch.meshgrid(torch.arange(H, dtype=torch.float64), torch.arange(W, dtype=torch.float64),
                          indexing="ij")
    depth = torch.empty(S, H, W, 1, dtype=torch.float64)
    for i in range(S):
        R, t = E[i, :, :3], E[i, :, 3]
        centre = -R.T @ t
        ray_cam = torch.stack([(u - W / 2) / 40.0, (v - H / 2) / 42.0, torch.ones_like(u)], -1)  # z = 1
        ray_world = ray_cam @ R  # R^T ray
        lam = (4.0 - centre[2]) / ray_world[..., 2]  # centre + lam * ray hits z = 4
        depth[i, ..., 0] = lam  # camera-z of the hit = lam because ray_cam has z = 1
    pts = unproject_depth_map_to_point_map(depth, E, K)
    assert pts.shape == (S, H, W, 3)
    assert torch.allclose(pts[..., 2], torch.full_like(pts[..., 2], 4.0), atol=1e-9)
    pts_np = unproject_depth_map_to_point_map(depth[..., 0].numpy(), E.numpy(), K.numpy())
    assert isinstance(pts_np, np.ndarray) and np.allclose(pts_np, pts.numpy())
    inv = closed_form_inverse_se3(E)
    assert torch.allclose(inv[:, :3, :3] @ E[:, :, :3], torch.eye(3, dtype=torch.float64).expand(S, 3, 3))


def test_confidence_mask():
    conf = torch.arange(1, 101, dtype=torch.float32).reshape(10, 10)
    assert confidence_mask(conf, percentile=50).sum() == 50
    assert confidence_mask(conf, percentile=None, threshold=91).sum() == 10
    assert confidence_mask(conf.numpy(), percentile=75, threshold=90).sum() == 11
    with pytest.raises(ValueError):
        confidence_mask(conf, percentile=None)


# ----------------------------------------------------------------------------- merge plan
def test_destinations_one_per_region():
    S, h, w = 3, 4, 5  # odd width: the last column has no region
    cfg = TokenMerging()
    P = 5 + h * w
    dst = _destination_mask(S, h, w, cfg).reshape(S, P)
    assert dst[0].all() and dst[:, :5].all()
    for f in range(1, S):
        grid = dst[f, 5:].reshape(h, w)
        for i in range(0, h, 2):
            for j in range(0, w - 1, 2):
                assert grid[i:i + 2, j:j + 2].sum() == 1
        assert not grid[:, w - 1].any()


def _naive_merge_attention(x_norm, q, k, v, S, h, w, cfg):
    """Independent loop reference of FastVGGT's merged attention for batch size 1."""
    N = x_norm.shape[1]
    dst = _destination_mask(S, h, w, cfg)
    n_prot = int(N * cfg.protect)
    prot = list(range(0, N, max(1, N // n_prot)))[:n_prot] if n_prot else []
    dst_ids = [i for i in range(N) if dst[i]]
    cand = [i for i in range(N) if not dst[i] and i not in prot]
    m = torch.nn.functional.normalize(x_norm[0].double(), dim=-1)
    best = {i: max(dst_ids, key=lambda j: float(m[i] @ m[j])) for i in cand}
    groups = {j: [j] for j in dst_ids}
    for i in cand:
        groups[best[i]].append(i)
    slots = [groups[j] for j in dst_ids] + [[p] for p in prot]
    qm = torch.stack([q[0, :, g].mean(1) for g in slots], 1)[None]
    km = torch.stack([k[0, :, g].mean(1) for g in slots], 1)[None]
    vm = torch.stack([v[0, :, g].mean(1) for g in slots], 1)[None]
    o = torch.nn.functional.scaled_dot_product_attention(qm.double(), km.double(), vm.double())
    owner = {}
    for s_i, g in enumerate(slots[:len(dst_ids)]):
        for tok in g:
            owner[tok] = s_i
    for p_i, p in enumerate(prot):
        owner[p] = len(dst_ids) + p_i
    return o[0, :, [owner[i] for i in range(N)]], len(slots)


def test_merge_plan_matches_naive_reference():
    torch.manual_seed(7)
    S, h, w, C, H = 3, 4, 6, 16, 2
    N = S * (5 + h * w)
    x = torch.randn(1, N, C)
    q, k, v = (torch.randn(1, H, N, C // H, dtype=torch.float64) for _ in range(3))
    cfg = TokenMerging()
    plan = plan_merge(x, S, h, w, cfg)
    ref, n_slots = _naive_merge_attention(x, q, k, v, S, h, w, cfg)
    assert plan.merged_len == n_slots < N
    o = torch.nn.functional.scaled_dot_product_attention(plan.merge(q), plan.merge(k), plan.merge(v))
    got = plan.unmerge(o.transpose(1, 2).reshape(1, plan.merged_len, C))  # [1, N, C]
    assert torch.allclose(got.reshape(1, N, H, C // H).transpose(1, 2), ref[None], atol=1e-10)


def test_merge_plan_edge_cases():
    x = torch.randn(1, 2 * (5 + 16), 8)
    assert plan_merge(x[:, :21], 1, 4, 4, TokenMerging()) is None  # one frame: nothing to merge
    assert plan_merge(x, 2, 4, 4, TokenMerging(ratio=0.0)) is None
    with pytest.raises(ValueError, match="global tokens"):
        plan_merge(x, 3, 4, 4, TokenMerging())
    with pytest.raises(ValueError, match="ratio"):
        TokenMerging(ratio=1.5)
    # ratio caps the merged sources; the least similar ones stay unmerged
    plan = plan_merge(x, 2, 4, 4, TokenMerging(ratio=0.05, protect=0.0))
    assert plan.src_idx.shape[1] == int(x.shape[1] * 0.05)


def _reference_plan(metric, S, h, w, cfg):
    """Straightforward plan (masks and ``nonzero`` per call, ``gather`` / ``scatter_add_`` merges) that the
    library's plan must reproduce exactly: (keep_idx, src_idx, src_slot, counts, source_map, merge, unmerge)."""
    B, N, _ = metric.shape
    is_dst = _destination_mask(S, h, w, cfg)
    n_prot = int(N * cfg.protect)
    prot = torch.arange(0, N, max(1, N // n_prot))[:n_prot]
    is_prot = torch.zeros(N, dtype=torch.bool)
    is_prot[prot] = True
    dst_idx = is_dst.nonzero().squeeze(1)
    cand = (~is_dst & ~is_prot).nonzero().squeeze(1)
    r = min(int(N * cfg.ratio), cand.numel())
    m = metric.float()
    m = m / m.norm(dim=-1, keepdim=True)
    sim = torch.bmm(m[:, cand], m[:, dst_idx].transpose(1, 2))
    best, arg = sim.max(dim=2)
    order = best.argsort(dim=1, descending=True)
    merged, kept = order[:, :r], order[:, r:]
    U, Dn, Pn = kept.shape[1], dst_idx.numel(), prot.numel()
    unm_tok, src_idx = cand[kept], cand[merged]
    src_slot = U + torch.gather(arg, 1, merged)
    keep_idx = torch.cat([unm_tok, dst_idx.expand(B, Dn), prot.expand(B, Pn)], dim=1)
    counts = torch.ones(B, U + Dn + Pn)
    counts.scatter_add_(1, src_slot, torch.ones_like(src_slot, dtype=counts.dtype))
    source_map = torch.empty(B, N, dtype=torch.long)
    source_map.scatter_(1, unm_tok, torch.arange(U).expand(B, U))
    source_map[:, dst_idx] = U + torch.arange(Dn)
    source_map.scatter_(1, src_idx, src_slot)
    source_map[:, prot] = U + Dn + torch.arange(Pn)

    def merge(t):
        Bt, H, _, D = t.shape
        M, R = keep_idx.shape[1], src_idx.shape[1]
        acc = torch.promote_types(t.dtype, torch.float32)
        out = torch.gather(t, 2, keep_idx[:, None, :, None].expand(Bt, H, M, D)).to(acc)
        src = torch.gather(t, 2, src_idx[:, None, :, None].expand(Bt, H, R, D))
        out.scatter_add_(2, src_slot[:, None, :, None].expand(Bt, H, R, D), src.to(acc))
        out /= counts[:, None, :, None]
        return out.to(t.dtype)

    def unmerge(o):
        return torch.gather(o, 1, source_map[:, :, None].expand(B, N, o.shape[2]))

    return keep_idx, src_idx, src_slot, counts, source_map, merge, unmerge


@pytest.mark.parametrize("B, dtype, ratio", [(1, torch.float32, 0.9), (1, torch.bfloat16, 0.9),
                                             (2, torch.float32, 0.9), (2, torch.bfloat16, 0.3),
                                             (1, torch.float64, 0.3)])
def test_merge_plan_matches_straightforward_plan_exactly(B, dtype, ratio):
    """Cached token sets, index_select / index_add_ (batch 1) and gather / scatter_add_ (batch > 1) give
    bit for bit the plan, merged q / k / v and unmerged output of the straightforward formulation."""
    gen = torch.Generator().manual_seed(11)
    S, h, w, C, H = 4, 5, 7, 32, 4  # odd grid: regions do not tile it
    N = S * (5 + h * w)
    cfg = TokenMerging(ratio=ratio, sim_chunk=17)  # several similarity chunks, the last one partial
    x = torch.randn(B, N, C, generator=gen)
    plan = plan_merge(x, S, h, w, cfg)
    keep_idx, src_idx, src_slot, counts, source_map, merge, unmerge = _reference_plan(x, S, h, w, cfg)
    assert torch.equal(plan.keep_idx, keep_idx) and torch.equal(plan.src_idx, src_idx)
    assert torch.equal(plan.src_slot, src_slot) and torch.equal(plan.counts, counts)
    assert torch.equal(plan.source_map, source_map)
    for _ in range(2):  # the second plan comes from the cached token sets
        t = torch.randn(B, H, N, C // H, generator=gen).to(dtype)
        assert torch.equal(plan.merge(t), merge(t))
        # q / k views of a fused qkv projection ([B, N, 3, H, D] permuted) are not contiguous
        qkv = torch.randn(B, N, 3, H, C // H, generator=gen).to(dtype).permute(2, 0, 3, 1, 4)
        assert torch.equal(plan.merge(qkv[1]), merge(qkv[1]))
        o = torch.randn(B, plan.merged_len, C, generator=gen).to(dtype)
        assert torch.equal(plan.unmerge(o), unmerge(o))
        assert torch.equal(plan_merge(x, S, h, w, cfg).source_map, source_map)
