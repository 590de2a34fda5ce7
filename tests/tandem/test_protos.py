"""The committed stubs in tandem/v1/ are what grpcio-tools generates from proto/ today."""
from __future__ import annotations

from tandem.protos import ROOT, generate


def test_stubs_are_current(tmp_path):
    generate(tmp_path)
    generated = sorted(p.name for p in (tmp_path / "tandem" / "v1").iterdir())
    committed = ROOT / "tandem" / "v1"
    assert generated == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    for name in generated:
        assert (tmp_path / "tandem" / "v1" / name).read_text() == (committed / name).read_text(), (
            f"tandem/v1/{name} is stale: run `python -m tandem.protos`"
        )
