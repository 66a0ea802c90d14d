"""The public surface is what each package's __all__ re-exports, pinned in tests/assets/public_api.txt.

Adding or removing a public name is a deliberate act: update the asset in the same change
(`python tests/test_public_api.py --write`), so the review sees the API diff.
"""

import importlib
import pathlib
import sys

PACKAGES = ["ember", "ember.core", "ember.core.step_fns", "ember.core.testing", "ember.core.partition_specs",
            "ember.core.checkpoint", "ember.optim",
            "ember.models", "ember.models.layers", "ember.data", "ember.launch"]
ASSET = pathlib.Path(__file__).parent / "assets" / "public_api.txt"


def current_api() -> str:
    lines = []
    for name in PACKAGES:
        module = importlib.import_module(name)
        exported = list(module.__all__)
        assert exported == sorted(exported), f"{name}.__all__ is not sorted"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ lists names it does not define: {missing}"
        lines += [f"{name}.{n}" for n in exported]
    return "\n".join(lines) + "\n"


def test_public_api_matches_the_pinned_list():
    want, got = ASSET.read_text().splitlines(), current_api().splitlines()
    added, removed = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not (added or removed), (
        f"public API changed: added {added}, removed {removed}. If intended, run "
        f"`python tests/test_public_api.py --write` and commit tests/assets/public_api.txt."
    )


if __name__ == "__main__" and "--write" in sys.argv:
    ASSET.write_text(current_api())
    print(f"wrote {ASSET}")
