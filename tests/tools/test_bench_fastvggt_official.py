"""tools/bench_fastvggt_official.py on the CPU, against a stand-in "official" checkout (visionattn's own tiny VGGT
behind the official code's constructor and update_patch_dimensions): every row runs, the weights load strictly,
the agreement, the files; a folder that is not a FastVGGT checkout exits 2."""
import json
import os
import textwrap

import pytest

from testdata import load_script

tool = load_script("tools/bench_fastvggt_official.py")

STAND_IN = textwrap.dedent('''
    from visionattn.models import VGGT as _VGGT


    class VGGT(_VGGT):
        """The official constructor's keywords over visionattn's model, on PyTorch SDPA, heads under autocast."""

        def __init__(self, merging=0, enable_point=False, enable_track=False, **config):
            super().__init__(**config, enable_point=enable_point, enable_track=enable_track, attn_mode=None,
                             heads_dtype="bf16")
            self.patch_dims = None

        def update_patch_dimensions(self, patch_width, patch_height):
            self.patch_dims = (patch_width, patch_height)
''')


def _checkout(root):
    for folder in ("vggt/models", "merging"):
        os.makedirs(root / folder, exist_ok=True)
    for init in ("vggt/__init__.py", "vggt/models/__init__.py", "merging/__init__.py", "merging/merge.py"):
        (root / init).write_text("")
    (root / "vggt/models/vggt.py").write_text(STAND_IN)
    return root


def test_every_row_on_a_stand_in_checkout(tmp_path):
    checkout = _checkout(tmp_path / "FastVGGT")
    out = str(tmp_path / "cmp")
    res = tool.main(["--official", str(checkout), "--tiny", "--device", "cpu", "--frames", "2", "--height", "28",
                     "--width", "42", "--fp32-heads", "--out", out])
    rows = [p["row"] for p in res["points"]]
    assert rows == ["official", "sdpa", "bf16", "free", "bf16-fp32-heads"]
    assert all(p["finite"] and p["time_s"] > 0 for p in res["points"])
    # the stand-in is visionattn's model on SDPA with bf16 heads: the sdpa row differs only by token merging
    agree = res["agreement"]["depth_rel_l2"]
    assert set(agree) == {"sdpa", "bf16", "bf16-fp32-heads"} and all(0 <= e < 1 for e in agree.values())
    saved = json.load(open(out + ".json"))
    assert saved["points"] == json.loads(json.dumps(res["points"]))
    md = open(out + ".md").read()
    assert "official FastVGGT code" in md and "attention-free (bound)" in md and "vs official" in md
    assert os.path.getsize(out + ".png") > 0


def test_a_folder_without_the_official_code_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--official", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "vggt/models/vggt.py" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
