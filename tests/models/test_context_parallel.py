"""models/context_parallel.py: a tiny VGGT with its frames split across 2 gloo processes equals 1 process.

One spawn runs every case in the workers (outputs of the local frames, parameter and image gradients,
the refusals) and returns (name, error, bound) rows and caught messages through files; the test asserts
here. Bound: the fp32 contract of visionattn.attention (2e-6) through a 2-block network, 1e-5 as
tests/models/test_vggt.py's batched-vs-single check.
"""
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from visionattn.metrics import rel_l2
from visionattn.models import VGGT, vggt_tiny_config
from visionattn.models.context_parallel import split_frames

TOL = 1e-5
FRAMES = (2, 1)  # rank 0: scene frames 0-1, rank 1: frame 2
KEYS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf")


def _model() -> VGGT:
    torch.manual_seed(0)
    model = VGGT(**vggt_tiny_config(), attn_mode="fp32")
    with torch.no_grad():  # the first-frame slots must differ visibly (they are initialised at 1e-6)
        model.aggregator.camera_token.normal_()
        model.aggregator.register_token.normal_()
    return model


def _images():
    return torch.rand(1, sum(FRAMES), 3, 42, 56, generator=torch.Generator().manual_seed(1))


def _loss(out: dict, s0: int, s1: int) -> torch.Tensor:
    """A loss over frames s0:s1 that reads every output the split changes (fixed weights per scene frame)."""
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
        # inference (eval): the single-process outputs of this rank's frames
        model.eval()
        with torch.no_grad():
            single = model(images)
            with split_frames(model) as split:
                mine = model(images[:, s0:s1])
                offset = split.frame_offset
            assert "attend_fn" not in vars(model.aggregator.global_blocks[0].attn)  # removed on exit
        for key in KEYS:
            rows.append((key, rel_l2(mine[key], single[key][:, s0:s1]), TOL))
        for i, (a, b) in enumerate(zip(mine["pose_enc_list"], single["pose_enc_list"])):
            rows.append((f"pose_enc_list[{i}]", rel_l2(a, b[:, s0:s1]), TOL))
        # training: gradients of the images and (summed over ranks) of the parameters
        model.train()
        params = dict(model.named_parameters())
        picked = ("aggregator.camera_token", "aggregator.global_blocks.0.attn.qkv.weight",
                  "aggregator.frame_blocks.1.mlp.fc1.weight", "camera_head.trunk.0.attn.qkv.weight",
                  "depth_head.scratch.output_conv2.0.weight")
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
        # refusals
        model.eval()
        with torch.no_grad(), split_frames(model):
            try:
                model(images[:, s0:s1], query_points=torch.tensor([[10.0, 12.0]]))
            except ValueError as e:
                caught["tracks"] = str(e)
        model.merging = {"start_block": 0}
        try:
            split_frames(model)
        except ValueError as e:
            caught["merging"] = str(e)
        torch.save({"rows": rows, "caught": caught, "offset": offset}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        gc.collect()  # free gloo p2p works held in cycles before the group goes (else: abort at exit)
        dist.destroy_process_group()


def test_split_frames_equals_one_process(tmp_path):
    world = len(FRAMES)
    mp.spawn(_worker, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert [r["offset"] for r in results] == [0, 2]
    bad = [f"rank {r}: {name}: {err:.3g} > {bound:.3g}" for r, res in enumerate(results)
           for name, err, bound in res["rows"] if not err <= bound]
    assert not bad, "\n".join(bad)
    for res in results:
        assert "track head needs the scene's frame 0" in res["caught"]["tracks"]
        assert "token merging" in res["caught"]["merging"]


def test_split_frames_needs_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        split_frames(_model())
