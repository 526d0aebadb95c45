"""``import visionattn`` needs only torch, triton and numpy; integrations import their library when used.

Each check runs in a fresh interpreter in which the optional libraries cannot be imported (a
meta-path finder refuses them), which is what an install without extras looks like.
"""
import subprocess
import sys
import textwrap

from testdata import REPO

OPTIONAL = ("timm", "cv2", "matplotlib", "yaml", "open3d", "diffusers", "transformers", "PIL", "scipy",
            "huggingface_hub", "safetensors", "tqdm")

_BLOCK = textwrap.dedent(f"""
    import sys
    class _Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {OPTIONAL!r}:
                raise ImportError(f"{{name}} is not installed (blocked by the test)")
            return None
    sys.meta_path.insert(0, _Refuse())
    import importlib.util
    _find = importlib.util.find_spec
    def _find_spec(name, package=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            return None
        return _find(name, package)
    importlib.util.find_spec = _find_spec
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_checkout_without_install_names_the_fix():
    """The checkout's visionattn without the install (``-S``: no site-packages, so no package-dir mapping) stops
    at ``import visionattn`` with an ImportError that names ``pip install -e .``, before importing anything else."""
    r = subprocess.run([sys.executable, "-S", "-c", "import visionattn"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "pip install -e ." in r.stderr, r.stderr


def test_import_and_attention_without_optional_libraries():
    r = _run("""
        import torch
        import visionattn as va
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {optional!r})
        q, k, v = (torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
        out = va.attention(q, k, v, mode="fp32", backend="reference")
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        print(loaded, float((out - ref).abs().max()))
    """.format(optional=OPTIONAL))
    assert r.returncode == 0, r.stderr
    loaded, err = r.stdout.split("]")
    assert loaded == "[", f"import visionattn loaded optional libraries: {loaded}]"
    assert float(err) < 1e-5


def test_patch_model_without_timm_patches_nothing_and_says_so():
    """Without timm no model can hold timm classes: patch_model on another model still works."""
    r = _run("""
        import torch
        import visionattn as va

        class Attention(torch.nn.Module):
            def forward(self, x):
                return x

        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Attention())
        va.patch_model(model, mode="fp32")
        rep = model.visionattn_report
        print(rep.num_patched, len(rep.skipped), "timm" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "False"]


def test_diffusers_integration_names_the_extra_when_missing():
    r = _run("""
        from visionattn.patching import diffusers as vd

        class LooksLikeADiffusersModel:
            attn_processors = {}

            def set_attn_processor(self, processors):
                pass

        try:
            vd.patch_diffusers(LooksLikeADiffusersModel(), mode="fp16")
        except ImportError as e:
            print("ImportError:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "pip install 'visionattn[video]'" in r.stdout


def test_patching_a_timm_model_does_not_import_transformers():
    """With every library installed, patch_model imports the providers of the libraries the model's modules come
    from: a timm model never pulls in transformers (or diffusers)."""
    code = textwrap.dedent("""
        import sys
        import timm
        import visionattn as va
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, img_size=32, patch_size=16)
        va.patch_model(model, mode="fp32")
        print(model.visionattn_report.num_patched, "transformers" in sys.modules, "diffusers" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "False", "False"]
