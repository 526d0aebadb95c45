"""split_frames on π³: a tiny Pi3 with its frames split across 2 gloo processes equals 1 process.

One spawn runs every case in the workers (outputs of the local frames, parameter and image gradients, the Pi3X
refusal) and returns (name, error, bound) rows and caught messages through a file per rank; the test asserts here.
Bound: the fp32 contract of visionattn.attention (2e-6) through a 4-block decoder, 1e-5 as
tests/models/test_context_parallel.py.
"""
import gc
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from visionattn.metrics import rel_l2
from visionattn.models import Pi3, Pi3X, pi3_tiny_config, pi3x_tiny_config
from visionattn.models.context_parallel import split_frames

TOL = 1e-5
FRAMES = (2, 1)  # rank 0: scene frames 0-1, rank 1: frame 2
KEYS = ("points", "local_points", "conf", "camera_poses")


def _model() -> Pi3:
    torch.manual_seed(0)
    model = Pi3(**pi3_tiny_config(), attn_mode="fp32")
    with torch.no_grad():  # registers visibly different from zero, so the global attention mixes frames
        model.register_token.normal_()
    return model


def _images():
    return torch.rand(1, sum(FRAMES), 3, 42, 56, generator=torch.Generator().manual_seed(1))


def _loss(out: dict, s0: int, s1: int) -> torch.Tensor:
    """A loss over frames s0:s1 of every output (fixed weights per scene frame)."""
    g = torch.Generator().manual_seed(2)
    total = 0
    for key in KEYS:
        w = torch.randn(out[key].shape[:1] + (sum(FRAMES),) + out[key].shape[2:], generator=g)
        total = total + (out[key] * w[:, s0:s1]).sum()
    return total


def _worker(rank: int, world: int, init: str, out_dir: str):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        s0, s1 = sum(FRAMES[:rank]), sum(FRAMES[:rank + 1])
        model, images = _model(), _images()
        rows, caught = [], {}
        model.eval()
        with torch.no_grad():
            single = model(images)
            with split_frames(model) as split:
                mine = model(images[:, s0:s1])
                frames = split.frames
            assert "attend_fn" not in vars(model.decoder[1].attn)  # removed on exit
        for key in KEYS:
            rows.append((key, rel_l2(mine[key], single[key][:, s0:s1]), TOL))
        # the global attention does cross the ranks: a run on this rank's frames alone differs by well over TOL
        # (the decoder's LayerScale starts at 0.01, so the frames mix weakly: ~2e-4)
        with torch.no_grad():
            alone = model(images[:, s0:s1])
        rows.append(("local run differs", 5 * TOL / max(rel_l2(alone["points"], single["points"][:, s0:s1]), 1e-30),
                     1.0))
        model.train()
        params = dict(model.named_parameters())
        picked = ("register_token", "decoder.1.attn.qkv.weight", "decoder.2.mlp.fc1.weight",
                  "camera_decoder.blocks.0.attn.qkv.weight", "point_head.proj.weight",
                  "encoder.patch_embed.proj.weight")
        x = images.clone().requires_grad_()
        model.zero_grad()
        _loss(model(x), 0, sum(FRAMES)).backward()
        gold = {n: params[n].grad.clone() for n in picked}
        gold_x = x.grad[:, s0:s1].clone()
        model.zero_grad()
        xs = images[:, s0:s1].clone().requires_grad_()
        with split_frames(model):
            _loss(model(xs), s0, s1).backward()
        for n in picked:
            g = params[n].grad.clone()
            dist.all_reduce(g)
            rows.append((f"grad {n}", rel_l2(g, gold[n]), TOL))
        rows.append(("grad images", rel_l2(xs.grad, gold_x), TOL))
        try:
            split_frames(Pi3X(**pi3x_tiny_config()))
        except TypeError as e:
            caught["pi3x"] = str(e)
        torch.save({"rows": rows, "caught": caught, "frames": frames}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        gc.collect()  # free gloo p2p works held in cycles before the group goes (else: abort at exit)
        dist.destroy_process_group()


def test_split_frames_pi3_equals_one_process(tmp_path):
    world = len(FRAMES)
    mp.spawn(_worker, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert [r["frames"] for r in results] == [list(FRAMES)] * world
    bad = [f"rank {r}: {name}: {err:.3g} > {bound:.3g}" for r, res in enumerate(results)
           for name, err, bound in res["rows"] if not err <= bound]
    assert not bad, "\n".join(bad)
    for res in results:
        assert "Pi3X" in res["caught"]["pi3x"] and "metric decoder" in res["caught"]["pi3x"]
