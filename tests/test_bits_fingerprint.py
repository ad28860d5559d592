"""Bits unchanged: a few (preset, policy) pairs of benchmarks/bits_fingerprint.py recomputed and compared with the
hashes it wrote (benchmarks/results/bits_fingerprint.json, recorded before the layer-seam refactor). The full
recomputation is the command `python benchmarks/bits_fingerprint.py --check`."""

import importlib.util
import os

import pytest

from jaxalign.numerics.platforms import effective_isa

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bits_fingerprint.py")
_SPEC = importlib.util.spec_from_file_location("bits_fingerprint", _PATH)
fp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fp)


@pytest.mark.parametrize("pair", fp.TEST_SUBSET)
def test_hashes_equal_the_recorded_ones(pair):
    isa = effective_isa()
    recorded = fp.load()
    assert isa in recorded, (f"no hashes recorded for ISA {isa!r} (recorded: {sorted(recorded)}); record them on "
                             f"unchanged code with: python benchmarks/bits_fingerprint.py --only {pair}")
    preset, policy, parts = fp.parse_pair(pair)
    want = recorded[isa]["pairs"][f"{preset}/{policy}"]
    got = fp.fingerprint(preset, policy, parts)
    assert set(got) == set(parts)
    for part in parts:
        assert got[part] == want[part], f"{preset}/{policy}:{part} changed"
