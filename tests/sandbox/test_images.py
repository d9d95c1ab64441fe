"""Base images are built from the Debian mirror apt already uses; no mirror's host name is written in the code."""

from __future__ import annotations

from agentrl.sandbox.images import BaseRecipe, apt_mirror


def test_the_mirror_is_the_one_apt_uses_in_either_format(tmp_path):
    deb822 = tmp_path / "a"
    (deb822 / "sources.list.d").mkdir(parents=True)
    (deb822 / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: file:///srv/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: file:///srv/mirror/debian/\nSuites: bookworm\n"
    )
    assert apt_mirror(deb822) == "file:///srv/mirror/debian"  # the security archive is not the mirror
    one_line = tmp_path / "b"
    one_line.mkdir()
    (one_line / "sources.list").write_text("deb [arch=amd64] file:///srv/debian bookworm main\n")
    assert apt_mirror(one_line) == "file:///srv/debian"


def test_without_an_apt_mirror_debootstrap_uses_its_own_default(tmp_path):
    (tmp_path / "sources.list").write_text("# nothing configured\n")
    assert apt_mirror(tmp_path) is None
    recipe = BaseRecipe(tag="t")
    # A recipe built from the default is told apart from one built from a named mirror (and is stable).
    assert recipe.digest(None) == recipe.digest(None) != recipe.digest("file:///srv/debian")
