"""Training through visionattn.models.VGGT: gradients in every attention mode, activation checkpointing.

References are independent of visionattn's attention: the same model on PyTorch SDPA
(``attn_mode=None``, same weights), and a float64 copy of it. The CPU runs use the tiny config
(visionattn's CPU path is the differentiable monoid reference); the GPU test runs VGGT-1B.
"""
import copy

import pytest
import torch

from testdata import load_script
from visionattn.metrics import rel_l2
from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config
from visionattn.modes import get_mode

KEYS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf", "track", "vis", "conf")
BACKWARD_MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16")  # visionattn.ops.BACKWARD_MODES on CUDA
UNUSED = {"aggregator.patch_embed.mask_token"}  # DINOv2's masking token: never read by VGGT (nor officially)


def _tiny(**kw) -> VGGT:
    torch.manual_seed(0)
    return VGGT(**vggt_tiny_config(**kw)).train()


def _images(S=3, H=28, W=42, device="cpu", seed=1) -> torch.Tensor:
    return torch.rand(S, 3, H, W, generator=torch.Generator(device).manual_seed(seed), device=device)


QP = torch.tensor([[5.0, 7.0], [20.0, 10.0]])


def _projection_loss(out: dict) -> torch.Tensor:
    """A scalar reading every output: sum_k mean(out_k * W_k) with fixed N(0, 1) weights W_k (seeded by key)."""
    total = 0
    for i, k in enumerate(KEYS):
        if k in out:
            v = out[k]
            g = torch.Generator(v.device).manual_seed(100 + i)
            w = torch.randn(v.shape, generator=g, device=v.device, dtype=torch.float32)
            total = total + (v * w.to(v.dtype)).mean()
    return total


def _grads(model: VGGT, images: torch.Tensor, mode, qp=QP, autocast_dtype=None,
           dtype=torch.float64) -> tuple[float, dict, torch.Tensor]:
    """(loss, {parameter: grad in ``dtype``}, d loss / d images) of one forward + backward in ``mode``."""
    model.set_attn_mode(mode)
    model.zero_grad(set_to_none=True)
    x = images.clone().requires_grad_()
    ctx = (torch.autocast(images.device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else torch.autocast(images.device.type, enabled=False))
    with ctx:
        out = model(x, None if qp is None else qp.to(x))
    loss = _projection_loss(out)
    loss.backward()
    grads = {n: p.grad.to(dtype) for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, x.grad.to(dtype)


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


@pytest.fixture(scope="module")
def float64_reference():
    """The tiny model's FP32 weights, and (loss, grads, image grads) of its float64 copy on SDPA."""
    model = _tiny()
    ref64 = copy.deepcopy(model).double()
    ref = _grads(ref64, _images().double(), None)
    return model, ref


# ----------------------------------------------------------------------------- differentiability and gradients
@pytest.mark.parametrize("mode", (None,) + BACKWARD_MODES)
def test_every_output_differentiable_every_mode(float64_reference, mode):
    """Every output reaches every parameter (but the unused mask token) and the images, in every mode with a
    backward; the gradients' relative L2 error against the float64 SDPA model is within the mode's contract
    (FP32 modes: at most twice the FP32 SDPA run's own error, plus 1e-6)."""
    model, (loss64, ref, ref_x) = float64_reference
    loss, grads, gx = _grads(model, _images(), mode)
    assert set(grads) == {n for n, _ in model.named_parameters()} - UNUSED
    assert torch.isfinite(_flat(grads)).all() and torch.isfinite(gx).all() and gx.abs().sum() > 0
    err, err_x = rel_l2(_flat(grads), _flat(ref)), rel_l2(gx, ref_x)
    if mode is None or get_mode(mode).rel_tol <= 2e-6:
        _, sdpa, sdpa_x = _grads(model, _images(), None)
        assert err <= 2 * rel_l2(_flat(sdpa), _flat(ref)) + 1e-6, err
        assert err_x <= 2 * rel_l2(sdpa_x, ref_x) + 1e-6, err_x
        assert abs(loss - loss64) <= 1e-5 * abs(loss64)
    else:
        tol = get_mode(mode).rel_tol
        assert err <= tol and err_x <= tol, (err, err_x, tol)


def test_fp32_gradients_match_sdpa_per_parameter(float64_reference):
    """visionattn fp32 vs the SDPA path with the same weights, parameter by parameter (FP32 rounding only)."""
    model, _ = float64_reference
    _, ours, ours_x = _grads(model, _images(), "fp32")
    _, sdpa, sdpa_x = _grads(model, _images(), None)
    assert ours.keys() == sdpa.keys()
    worst = max(ours, key=lambda n: rel_l2(ours[n], sdpa[n]))
    assert rel_l2(ours[worst], sdpa[worst]) <= 1e-4, worst
    assert rel_l2(_flat(ours), _flat(sdpa)) <= 1e-5 and rel_l2(ours_x, sdpa_x) <= 1e-5


def test_half_autocast_training_is_differentiable():
    """bf16 autocast with "auto" attention (bf16 kernels) and half heads: every parameter still gets a gradient."""
    model = _tiny(heads_dtype="bf16")
    _, grads, gx = _grads(model, _images(), "auto", autocast_dtype=torch.bfloat16)
    assert set(grads) == {n for n, _ in model.named_parameters()} - UNUSED
    assert torch.isfinite(_flat(grads)).all() and torch.isfinite(gx).all()


# ----------------------------------------------------------------------------- activation checkpointing
def _count_calls(modules) -> tuple[list, list]:
    counts = [0] * len(modules)
    handles = [m.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
               for i, m in enumerate(modules)]
    return counts, handles


@pytest.mark.parametrize("merging", [None, FASTVGGT_MERGING])
def test_checkpointing_gives_identical_gradients(merging):
    """Checkpointed aggregator blocks and DPT chunks (2 frames per chunk over 3 frames) recompute in backward
    and give bit-identical gradients; FastVGGT's merge plan is rebuilt identically in the recomputation."""
    model = _tiny(merging=merging, frames_chunk_size=2, patch_embed_chunk_size=2)
    agg = model.aggregator
    watched = [agg.frame_blocks[0], agg.global_blocks[1], agg.patch_embed.blocks[0],
               model.depth_head.scratch.output_conv1, model.camera_head.trunk[0]]
    runs = []
    for enable in (False, True):
        model.set_grad_checkpointing(enable)
        counts, handles = _count_calls(watched)
        runs.append(_grads(model, _images(), "fp32"))
        for h in handles:
            h.remove()
        # checkpointed: each block once in forward, once recomputed; the patch embed and the DPT head run 2
        # chunks each; the camera trunk (one token per frame, 4 iterations) is never checkpointed
        assert counts == ([2, 2, 4, 4, 4] if enable else [1, 1, 2, 2, 4]), (enable, counts)
    (l0, g0, x0), (l1, g1, x1) = runs
    assert l0 == l1 and g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    assert torch.equal(x0, x1)


def test_set_grad_checkpointing_switches_every_stage():
    model = VGGT(**vggt_tiny_config(), grad_checkpointing=True)
    stages = [model.aggregator, model.aggregator.patch_embed, model.depth_head, model.point_head,
              model.track_head.feature_extractor]
    assert model.grad_checkpointing and all(s.grad_checkpointing for s in stages)
    assert model.set_grad_checkpointing(False) is model
    assert not model.grad_checkpointing and not any(s.grad_checkpointing for s in stages)
    assert "grad_checkpointing" not in model.config  # a runtime choice, like attn_mode: not saved
    with pytest.raises(TypeError, match="enable"):
        model.set_grad_checkpointing("yes")


def test_inference_unchanged_by_checkpointing():
    """Under no_grad checkpointing is inactive (blocks run once); with grad enabled the outputs are the same bits."""
    model = _tiny().eval()
    x = _images()
    with torch.no_grad():
        ref = model(x, QP)
        model.set_grad_checkpointing(True)
        counts, handles = _count_calls([model.aggregator.frame_blocks[0]])
        got = model(x, QP)
        for h in handles:
            h.remove()
    assert counts == [1]
    with_grad = model(x, QP)
    for k in KEYS:
        assert torch.equal(got[k], ref[k]) and torch.equal(with_grad[k], ref[k]), k
        assert with_grad[k].requires_grad and not got[k].requires_grad, k


# ----------------------------------------------------------------------------- optimisation
def _adamw_curve(model: VGGT, mode, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps pulling depth toward a fixed ramp and the pose toward zero."""
    model.set_attn_mode(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x = _images(S=2)
    target = torch.linspace(0.5, 2.0, x.shape[-1]).expand(1, *x.shape[:1], x.shape[-2], x.shape[-1])[..., None]
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = (out["depth"] - target).square().mean() + out["pose_enc"].square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_adamw_steps_follow_the_sdpa_curve():
    """A few AdamW steps decrease the loss; visionattn fp32 (with and without checkpointing) follows SDPA's curve."""
    kw = dict(enable_track=False, enable_point=False)
    sdpa = _adamw_curve(_tiny(**kw), None, 6)
    ours = _adamw_curve(_tiny(**kw), "fp32", 6)
    ckpt = _adamw_curve(_tiny(**kw, grad_checkpointing=True), "fp32", 6)
    assert sdpa[-1] < 0.7 * sdpa[0], sdpa
    for a, b, c in zip(ours, sdpa, ckpt):
        assert abs(a - b) <= 1e-4 * abs(b), (ours, sdpa)
        assert a == c, (ours, ckpt)


# ----------------------------------------------------------------------------- GPU: VGGT-1B
def _peak_step(model, images, mode, dtype):
    """(loss, grads as one FP32 vector on the GPU, image grads, peak bytes above the start: gradients and
    activations) of one step."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, grads, gx = _grads(model, images, mode, qp=None, autocast_dtype=dtype, dtype=torch.float32)
    peak = torch.cuda.max_memory_allocated() - base
    flat = torch.cat([g.flatten() for g in grads.values()])
    model.zero_grad(set_to_none=True)
    return loss, flat, gx, peak


@pytest.mark.gpu
def test_vggt_1b_training_gradients_and_checkpoint_memory():
    """VGGT-1B, 4 frames 392x518, no track queries: gradients of every parameter and of the images in visionattn
    fp32 / bf16 vs the SDPA path in the same precision, both measured against a float64 SDPA copy (ours within
    twice SDPA's error plus a floor); checkpointing on: same gradients, lower peak memory."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = VGGT().train()
    images = _images(S=4, H=392, W=518, device="cuda")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref64 = copy.deepcopy(model).double().set_grad_checkpointing(True)
        _, ref, ref_x = _grads(ref64, images.double(), None, qp=None)
        ref = torch.cat([g.float().flatten() for g in ref.values()])
        del ref64
        runs = {}
        for name, mode, dtype, ckpt in (("sdpa-fp32", None, None, False), ("fp32", "fp32", None, False),
                                        ("fp32-ckpt", "fp32", None, True), ("sdpa-bf16", None, torch.bfloat16, False),
                                        ("bf16", "bf16", torch.bfloat16, False),
                                        ("bf16-ckpt", "bf16", torch.bfloat16, True)):
            model.set_grad_checkpointing(ckpt)
            runs[name] = _peak_step(model, images, mode, dtype)
    for name, (loss, g, gx, peak) in runs.items():
        print(f"{name}: loss {loss:.6g}  grad rel L2 {rel_l2(g, ref):.3g}  image grad {rel_l2(gx, ref_x):.3g}  "
              f"peak {peak / 2**30:.2f} GiB")
    for ours, base, floor in (("fp32", "sdpa-fp32", 1e-6), ("fp32-ckpt", "sdpa-fp32", 1e-6),
                              ("bf16", "sdpa-bf16", 1e-3), ("bf16-ckpt", "sdpa-bf16", 1e-3)):
        _, g, gx, _ = runs[ours]
        _, gb, gbx, _ = runs[base]
        assert torch.isfinite(g).all() and torch.isfinite(gx).all(), ours
        assert rel_l2(g, ref) <= 2 * rel_l2(gb, ref) + floor, ours
        assert rel_l2(gx, ref_x) <= 2 * rel_l2(gbx, ref_x) + floor, ours
    # FP32: checkpointing changes the gradients only by the order of CUDA's non-deterministic backward sums
    # (bilinear upsampling, convolution weight gradients); under bf16 autocast those reorderings flip bf16
    # roundings, so that two plain bf16 steps already differ by ~5e-3 (H100), and the float64 bound is the check
    assert rel_l2(runs["fp32-ckpt"][1], runs["fp32"][1]) <= 1e-5
    # H100, weights included (tools/bench_vggt.py --train-step): 9.3 vs 30.8 GiB (fp32), 9.3 vs 24.1 GiB (bf16)
    for mode in ("fp32", "bf16"):
        assert runs[f"{mode}-ckpt"][3] < 0.75 * runs[mode][3], (mode, runs[f"{mode}-ckpt"][3], runs[mode][3])


# ----------------------------------------------------------------------------- tools/bench_vggt.py --train-step
def test_bench_vggt_train_step_on_cpu_tiny(tmp_path):
    import json

    tool = load_script("tools/bench_vggt.py")
    out = str(tmp_path / "train")
    res = tool.main(tool.parser.parse_args(["--train-step", "--tiny", "--device", "cpu", "--models", "vggt",
                                            "--rows", "fp32", "--frames", "2", "--height", "28", "--width", "28",
                                            "--out", out]))
    pts = json.load(open(out + ".json"))["train"]["vggt"]
    assert pts == res["train"]["vggt"]
    off, on = pts["fp32"]["2"]["off"], pts["fp32"]["2"]["on"]
    assert off["finite"] and off["time_s"] > 0 and on["loss"] == off["loss"]
    assert "visionattn fp32 | 2 |" in open(out + ".md").read()
