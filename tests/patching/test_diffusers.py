"""diffusers integration: ELSAAttnProcessor / patch_diffusers / unpatch_diffusers.

References are diffusers' own modules: the unpatched model (default processor,
PyTorch SDPA) run in float64 is the oracle each mode's contract is measured
against (docs/design.md, "Modes"); the overflow case follows the PASA paper's
large-bias inputs (Table 4, uniform x0 = 30, Am = 0.5, D = 128).
"""
import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import AutoencoderKLTemporalDecoder, UNetSpatioTemporalConditionModel  # noqa: E402
from diffusers.models.attention_processor import (  # noqa: E402
    Attention, AttnProcessor, AttnProcessor2_0, SlicedAttnProcessor)

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import get_mode  # noqa: E402
from testdata import load_script  # noqa: E402
from visionattn.patching.diffusers import (  # noqa: E402
    ELSAAttnProcessor, is_patched, overflow_counts, patch_diffusers, reset_overflow_counts, unpatch_diffusers)

tf32_flags = load_script("tools/_harness.py").tf32_flags  # process-wide: tools and tests only

CONTRACT_MODES = ["fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa"]


def tiny_unet(seed=0):
    torch.manual_seed(seed)
    return UNetSpatioTemporalConditionModel(
        sample_size=4, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=32, num_attention_heads=(2, 4), addition_time_embed_dim=32,
        projection_class_embeddings_input_dim=96, num_frames=3).eval()


def unet_inputs(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 8, 8, generator=g)           # [B, F, 2*C_latent, h, w]
    enc = torch.randn(2, 1, 32, generator=g)               # one CLIP image token
    t = torch.tensor([3.0])
    ids = torch.tensor([[6.0, 127.0, 0.02]]).repeat(2, 1)  # fps, motion bucket, noise aug
    return [a.to(dtype) for a in (x, t, enc, ids)]


@pytest.fixture(scope="module")
def unet_and_oracle():
    unet = tiny_unet()
    with torch.no_grad():
        oracle = copy.deepcopy(unet).double()(*unet_inputs(torch.float64)).sample
    return unet, oracle


def test_patch_replaces_every_default_processor_and_unpatch_restores_them(unet_and_oracle):
    unet, _ = unet_and_oracle
    before = unet.attn_processors
    with torch.no_grad():
        y0 = unet(*unet_inputs()).sample
    report = patch_diffusers(unet, "fp32")
    try:
        procs = unet.attn_processors
        # spatial + temporal transformer blocks, self (attn1) and cross (attn2) attention
        assert any(".temporal_transformer_blocks." in k and k.endswith("attn2.processor") for k in procs)
        assert all(isinstance(p, ELSAAttnProcessor) and p.mode == "fp32" and p.name == k for k, p in procs.items())
        assert len({id(p) for p in procs.values()}) == len(procs)  # one processor (counter) per layer
        assert report["replaced"] == {"AttnProcessor2_0": len(before)} and report["skipped"] == []
        assert report["attention_modules"] == report["replaced_total"] == len(before)
        assert is_patched(unet)
    finally:
        unpatch_diffusers(unet)
    after = unet.attn_processors
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert not is_patched(unet)
    with torch.no_grad():
        assert torch.equal(unet(*unet_inputs()).sample, y0)


@pytest.mark.parametrize("mode", CONTRACT_MODES)
def test_patched_noise_prediction_within_mode_contract(unet_and_oracle, mode):
    unet, oracle = unet_and_oracle
    patch_diffusers(unet, mode)
    try:
        with torch.no_grad():
            y = unet(*unet_inputs()).sample
        counts = overflow_counts(unet)
    finally:
        unpatch_diffusers(unet)
    assert torch.isfinite(y).all()
    assert counts["calls"] == len(unet.attn_processors) and counts["overflow_events"] == 0
    assert rel_l2(y, oracle) <= get_mode(mode).rel_tol


def test_unpatched_fp32_unet_meets_fp32_contract_too(unet_and_oracle):
    # the bound above is not loose for fp32: PyTorch's own FP32 attention sits at the same level
    unet, oracle = unet_and_oracle
    with torch.no_grad():
        assert rel_l2(unet(*unet_inputs()).sample, oracle) <= get_mode("fp32").rel_tol


def test_custom_processors_are_skipped_and_kept():
    unet = tiny_unet()
    keys = list(unet.attn_processors)
    custom = SlicedAttnProcessor(slice_size=1)
    procs = dict(unet.attn_processors)
    procs[keys[0]] = custom
    procs[keys[1]] = AttnProcessor()  # the other default diffusers uses (scale_qk=False)
    unet.set_attn_processor(procs)
    report = patch_diffusers(unet, "fp16", count_overflow=False)
    patched = unet.attn_processors
    assert patched[keys[0]] is custom
    assert report["skipped"] == [{"name": keys[0], "processor": "SlicedAttnProcessor",
                                  "reason": report["skipped"][0]["reason"]}]
    assert "not a default processor" in report["skipped"][0]["reason"]
    assert report["replaced"] == {"AttnProcessor": 1, "AttnProcessor2_0": len(keys) - 2}
    assert not patched[keys[1]].count_overflow


def test_repatch_changes_mode_and_unpatch_restores_originals():
    unet = tiny_unet()
    before = unet.attn_processors
    patch_diffusers(unet, "fp16")
    report = patch_diffusers(unet, "bf16")
    assert report["repatched"] and {p.mode for p in unet.attn_processors.values()} == {"bf16"}
    unpatch_diffusers(unet)
    assert all(unet.attn_processors[k] is before[k] for k in before)


def test_errors_name_the_fix():
    unet = tiny_unet()
    with pytest.raises(ValueError, match="not patched"):
        unpatch_diffusers(unet)
    with pytest.raises(ValueError, match="mode"):
        patch_diffusers(unet, "fp8")
    with pytest.raises(TypeError, match="unknown option"):
        patch_diffusers(unet, "fp32", block_size=64)
    with pytest.raises(TypeError, match="attn_processors"):
        patch_diffusers(torch.nn.Linear(2, 2))
    assert not is_patched(unet)


def _module_pair(**kw):
    torch.manual_seed(0)
    attn = Attention(**kw).eval()
    ref = copy.deepcopy(attn).double()
    ref.set_processor(AttnProcessor2_0())
    attn.set_processor(ELSAAttnProcessor("fp32"))
    return attn, ref


def test_processor_vae_branches_group_norm_residual_rescale_4d():
    # the VAE mid-block attention: [B, C, H, W] input, group norm, residual, output rescale
    attn, ref = _module_pair(query_dim=64, heads=2, dim_head=32, norm_num_groups=8, residual_connection=True,
                             rescale_output_factor=2.0, bias=True, upcast_softmax=True)
    x = torch.randn(2, 64, 5, 7)
    with torch.no_grad():
        y, y_ref = attn(x), ref(x.double())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_l2(y, y_ref) <= get_mode("fp32").rel_tol


def test_processor_spatial_norm_with_temb():
    attn, ref = _module_pair(query_dim=32, heads=2, dim_head=16, spatial_norm_dim=4, residual_connection=True)
    x, zq = torch.randn(1, 32, 4, 6), torch.randn(1, 4, 2, 3)
    with torch.no_grad():
        y, y_ref = attn(x, temb=zq), ref(x.double(), temb=zq.double())
    assert rel_l2(y, y_ref) <= get_mode("fp32").rel_tol


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_processor_cross_attention_masks(kind):
    attn, ref = _module_pair(query_dim=32, heads=4, dim_head=8, cross_attention_dim=24,
                             cross_attention_norm="layer_norm")
    x, enc = torch.randn(3, 10, 32), torch.randn(3, 7, 24)
    keep = torch.rand(3, 1, 7) > 0.4
    keep[..., 0] = True
    mask = keep if kind == "bool" else torch.where(keep, 0.0, -10000.0)
    with torch.no_grad():
        y = attn(x, encoder_hidden_states=enc, attention_mask=mask)
        y_ref = ref(x.double(), encoder_hidden_states=enc.double(),
                    attention_mask=mask if kind == "bool" else mask.double())
    assert rel_l2(y, y_ref) <= get_mode("fp32").rel_tol


def test_vae_model_patch_covers_mid_block_attention():
    torch.manual_seed(0)
    vae = AutoencoderKLTemporalDecoder(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                                       layers_per_block=1, latent_channels=4).eval()
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        z = copy.deepcopy(vae).double().encode(x.double()).latent_dist.mode()
        report = patch_diffusers(vae, "fp32")
        try:
            z_elsa = vae.encode(x).latent_dist.mode()
        finally:
            unpatch_diffusers(vae)
    assert report["replaced_total"] == 2  # encoder + decoder mid-block attention
    assert rel_l2(z_elsa, z) <= get_mode("fp32").rel_tol


def _large_bias_module():
    """Cross attention whose q, k ~ U(29.5, 30.5) (PASA paper, Table 4: uniform x0=30, Am=0.5), D=128."""
    c = 256
    attn = Attention(query_dim=c, cross_attention_dim=c, heads=2, dim_head=128, bias=True).eval()
    with torch.no_grad():
        for lin in (attn.to_q, attn.to_k):
            lin.weight.copy_(0.5 * torch.eye(c))
            lin.bias.fill_(30.0)
    return attn


@pytest.mark.parametrize("mode", ["fp16-acc16", "pasa"])
def test_injected_large_bias_overflows_fp16_accumulation_not_pasa(mode):
    torch.manual_seed(0)
    attn = _large_bias_module()
    x = torch.rand(1, 256, 256) * 2 - 1    # q = 30 + x / 2
    enc = torch.rand(1, 256, 256) * 2 - 1  # k = 30 + enc / 2
    with torch.no_grad():
        q = attn.to_q(x)
        assert q.min() >= 29.5 and q.max() <= 30.5
        ref = copy.deepcopy(attn).double()
        y_ref = ref(x.double(), encoder_hidden_states=enc.double())
        attn.set_processor(ELSAAttnProcessor("fp16"))
        y_fp16 = attn(x, encoder_hidden_states=enc)   # FP16 inputs, FP32 accumulation: the paper's baseline
        proc = ELSAAttnProcessor(mode)
        attn.set_processor(proc)
        y = attn(x, encoder_hidden_states=enc)
    assert proc.calls == 1
    if mode == "fp16-acc16":
        assert not torch.isfinite(y).all()
        assert proc.overflow_events == 1 and proc.nonfinite_outputs == 1
    else:
        assert torch.isfinite(y).all() and proc.overflow_events == 0 and proc.nonfinite_outputs == 0
        # PASA recovers the removed pseudo-average as beta / (1 - beta) * rowmean(S') (PASA paper,
        # Eq. 13-15), so FP16 rounding of S' reaches the logits amplified by up to 1 / (1 - beta):
        # finite, and at most that factor less accurate than FP16 inputs with FP32 accumulation.
        from visionattn.pasa import optimal_beta

        assert rel_l2(y, y_ref) <= rel_l2(y_fp16, y_ref) / (1 - optimal_beta(128))
    proc.reset_counters()
    assert proc.calls == 0 and proc.overflow_events == 0


def test_counters_sum_over_layers_and_reset(unet_and_oracle):
    unet, _ = unet_and_oracle
    patch_diffusers(unet, "fp32")
    try:
        with torch.no_grad():
            unet(*unet_inputs())
            unet(*unet_inputs())
        assert overflow_counts(unet)["calls"] == 2 * len(unet.attn_processors)
        reset_overflow_counts(unet)
        assert overflow_counts(unet) == {"calls": 0, "nonfinite_outputs": 0, "overflow_events": 0, "layers": {}}
    finally:
        unpatch_diffusers(unet)


def test_nan_input_counts_as_nonfinite_not_overflow():
    attn, _ = _module_pair(query_dim=16, heads=2, dim_head=8, bias=True)
    with torch.no_grad():
        attn.to_v.bias[3] = float("nan")  # a NaN value channel: fed NaN, not produced by attention
        attn(torch.randn(1, 5, 16))
    assert attn.processor.nonfinite_outputs == 1 and attn.processor.overflow_events == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16", "pasa"])
def test_gpu_patched_unet_within_contract(mode):
    unet = tiny_unet()
    with torch.no_grad():
        oracle = copy.deepcopy(unet).double()(*unet_inputs(torch.float64)).sample
    unet.cuda()
    patch_diffusers(unet, mode)
    with torch.no_grad(), tf32_flags():  # cuDNN convolutions default to TF32 on the GPU
        y = unet(*[a.cuda() for a in unet_inputs()]).sample.cpu()
    assert overflow_counts(unet)["overflow_events"] == 0
    unpatch_diffusers(unet)
    assert rel_l2(y, oracle) <= get_mode(mode).rel_tol


def test_public_patch_model_delegates_to_diffusers_patcher():
    import visionattn

    unet = tiny_unet()
    before = unet.attn_processors
    assert visionattn.patch_model(unet, "fp16", num_splits=1) is unet
    report = unet.visionattn_report
    assert report.delegated == "diffusers" and report.details["replaced_total"] == len(before)
    assert all(p.mode == "fp16" and p.num_splits == 1 for p in unet.attn_processors.values())
    visionattn.unpatch_model(unet)
    assert all(unet.attn_processors[k] is before[k] for k in before) and not is_patched(unet)


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_processor_through_triton_kernels(mode, device):
    # on CPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=2, dim_head=16, cross_attention_dim=24).eval()
    ref = copy.deepcopy(attn).double()
    attn.to(device).set_processor(ELSAAttnProcessor(mode, backend="triton"))
    x, enc = torch.randn(2, 40, 32), torch.randn(2, 7, 24)
    bias = torch.where(torch.rand(2, 1, 7) > 0.3, 0.0, -10000.0)
    with torch.no_grad():
        y = attn(x.to(device), encoder_hidden_states=enc.to(device), attention_mask=bias.to(device)).cpu()
        y_ref = ref(x.double(), encoder_hidden_states=enc.double(), attention_mask=bias.double())
    assert rel_l2(y, y_ref) <= get_mode(mode).rel_tol
