"""tools/drift_table.py reproduces the supplement's Table 1 properties on CPU."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import drift_table  # noqa: E402


def test_drift_table_quick(tmp_path):
    out = str(tmp_path / "table1")
    results = drift_table.main(["--quick", "--out", out])
    assert json.load(open(out + ".json"))["scenarios"].keys() == {"regular", "long", "stress"}
    assert "argmax disagreement" in open(out + ".md").read()
    for entry in results["scenarios"].values():
        for label, bound in (("scan_fp64", 1e-13), ("scan_fp32", 2e-6)):
            m = entry[label]
            assert m["argmax_disagree"]["overall"] == 0
            assert m["rel_l2_dY"]["overall"] <= bound
            assert m["rel_l2_dP"]["overall"] <= bound
