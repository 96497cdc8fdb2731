"""The documentation: the configuration reference names every key the wrappers accept, and the
README stays a short front page that points into docs/."""

from __future__ import annotations

import re
from pathlib import Path

from shardwise.zero import front_door

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"


def documented_keys(section: str) -> set[str]:
    """The keys in the first column of the tables under the heading that names `section`."""
    text = CONFIGURATION.read_text()
    start = text.index(f"## `{section}`")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return set(re.findall(r"^\| `(\w+)` \|", body, flags=re.MULTILINE))


def test_configuration_reference_names_every_gemini_config_key() -> None:
    keys = set(front_door.GEMINI_CONFIG_KEYS) | set(front_door.LOW_LEVEL_KEYS)
    missing = sorted(keys - documented_keys("gemini_config"))
    assert not missing, f"docs/configuration.md lacks gemini_config keys {missing}"


def test_configuration_reference_names_every_optim_config_key() -> None:
    missing = sorted(set(front_door.OPTIM_CONFIG_KEYS) - documented_keys("optim_config"))
    assert not missing, f"docs/configuration.md lacks optim_config keys {missing}"


def test_configuration_reference_names_no_key_that_is_refused() -> None:
    # A key removed from the code but left in the docs would tell users to set what is refused.
    extra = sorted(documented_keys("gemini_config") - set(front_door.GEMINI_CONFIG_KEYS))
    extra += sorted(documented_keys("optim_config") - set(front_door.OPTIM_CONFIG_KEYS))
    assert not extra, f"docs/configuration.md names keys the wrappers refuse: {extra}"


def test_readme_is_short_and_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "README.md is the front page: move detail to docs/"
    for command in ("./dev demo", "./dev test"):
        assert command in readme
    assert "What changed in each version: [CHANGELOG.md](CHANGELOG.md)" in readme
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert "docs/configuration.md" in linked and "docs/install.md" in linked
    broken = sorted(path for path in linked if not (ROOT / path).exists())
    assert not broken, f"README.md links to missing docs pages {broken}"
