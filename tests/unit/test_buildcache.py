"""support.buildcache: one build per content hash, and an older build of the same name pruned,
never a build of another name that begins with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from support import buildcache


def _write(text: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        path.write_text(text)

    return build


def test_a_new_build_prunes_its_own_older_one_and_not_a_longer_name_beginning_with_it(tmp_path: Path) -> None:
    old = buildcache.ensure(tmp_path, "prometheus", buildcache.key([b"1"]), _write("old"), ".tar")
    other = buildcache.ensure(
        tmp_path, "prometheus-config-reloader", buildcache.key([b"1"]), _write("reloader"), ".tar"
    )
    new = buildcache.ensure(tmp_path, "prometheus", buildcache.key([b"2"]), _write("new"), ".tar")
    assert not old.exists()
    assert new.read_text() == "new"
    assert other.read_text() == "reloader"  # before the fix the prune's glob took it too


def test_the_same_inputs_are_built_once(tmp_path: Path) -> None:
    built: list[Path] = []

    def build(path: Path) -> None:
        built.append(path)
        path.write_text("x")

    first = buildcache.ensure(tmp_path, "tool", buildcache.key([b"a"]), build)
    again = buildcache.ensure(tmp_path, "tool", buildcache.key([b"a"]), build)
    assert first == again
    assert len(built) == 1
