"""patch_model / unpatch_model hand diffusers models to visionattn.patching.diffusers."""
import pytest
import torch

import visionattn as va
from visionattn.metrics import rel_l2

diffusers = pytest.importorskip("diffusers")


def _tiny_vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
                                   down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
                                   layers_per_block=1).eval()


def test_diffusers_model_is_delegated_and_restored():
    vae = _tiny_vae()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _tiny_vae().double()(x.double()).sample
        y0 = vae(x).sample
        va.patch_model(vae, "fp32")
        rep = vae.visionattn_report
        y = vae(x).sample
        va.unpatch_model(vae)
        va.unpatch_model(vae)  # unpatching an unpatched model is a no-op
        y2 = vae(x).sample
    assert rep.delegated == "diffusers" and rep.num_patched == rep.details["replaced_total"] == 2  # enc + dec mid
    assert rel_l2(y, ref) <= max(4 * rel_l2(y0, ref), va.get_mode("fp32").rel_tol)
    assert torch.equal(y2, y0) and not hasattr(vae, "visionattn_report")
