"""The package's shape (DESIGN.md, "Layout"): imports only go down, and no module is so
long that it holds two jobs."""

from __future__ import annotations

import re

from tests.import_cycles import (
    cycles,
    import_graph,
    module_names,
    package_root,
    strongly_connected,
)
from tests.test_public_modules import PUBLIC

#: a module past this many lines is a sign it holds two responsibilities
MAX_LINES = 600


def test_the_package_has_no_import_cycle():
    found = cycles()
    assert found == [], (
        f"{len(found)} import cycle(s) (python tests/import_cycles.py lists them): "
        + "; ".join(", ".join(c) for c in found)
        + ". A lower module should be handed what it needs (a callable, the groups) "
        "instead of importing the module above it, even lazily"
    )


def test_no_module_is_longer_than_600_lines():
    long = {}
    for name, path in module_names(package_root()).items():
        with open(path, encoding="utf-8") as fp:
            count = sum(1 for _ in fp)
        if count > MAX_LINES:
            long[name] = count
    assert not long, (
        f"modules over {MAX_LINES} lines: {dict(sorted(long.items()))}; split each along "
        "its responsibilities"
    )


# -- the map of the house (docs/architecture.md, "The house") --------------------------

ARCHITECTURE = package_root().parent / "docs" / "architecture.md"
_ROOM = re.compile(r"(_{0,2}[a-z][a-z0-9_]*)(\.py|/)")


def house_map() -> tuple[dict[str, str], set[str]]:
    """The map's rooms: room -> floor, and the rooms it marks `(public)`.

    The map is the ```text block of the section "The house": a line whose first column
    names a floor starts that floor; the room column (up to the job column, where the
    header's dashes say) names rooms as `name.py` or `folder/`, a room marked public
    with "(public)" after it.
    """
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("## The house", 1)[1].split("\n## ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    header, dashes, lines = block[0], block[1], block[2:]
    floor_end = dashes.index(" ")
    room_end = dashes.index(" ", floor_end + 2)
    assert header.split()[:2] == ["floor", "room"], header
    floors: dict[str, str] = {}
    public: set[str] = set()
    floor = ""
    for line in lines:
        floor = line[:floor_end].strip() or floor
        cell = line[floor_end:room_end]
        for match in _ROOM.finditer(cell):
            name = match.group(1)
            assert name not in floors, f"the map names {name} twice"
            floors[name] = floor
            if cell[match.end() :].lstrip().startswith("(public)"):
                public.add(name)
    return floors, public


def _room(module: str) -> str:
    """The room of a module: its top-level module or folder (`distcomm` itself:
    `__init__`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        room = _room(module)
        graph.setdefault(room, set()).update(_room(t) for t in targets)
    for room, targets in graph.items():
        targets.discard(room)
    return graph


def test_the_map_of_the_house_names_every_room_once_and_nothing_else():
    floors, _ = house_map()
    root = package_root()
    rooms = {
        p.stem if p.is_file() else p.name
        for p in root.iterdir()
        if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())
    }
    missing, extra = sorted(rooms - set(floors)), sorted(set(floors) - rooms)
    assert not missing and not extra, (
        f"docs/architecture.md's map of the house lacks {missing} and names {extra}, "
        "which do not exist: put every top-level module and folder of distcomm on one floor"
    )


def test_the_rooms_the_map_marks_public_are_the_public_modules():
    _, public = house_map()
    listed = {m.split(".")[1] if "." in m else "__init__" for m in PUBLIC}
    assert public == listed, (
        f"the map marks {sorted(public - listed)} public, which the API page's table does "
        f"not list, and leaves {sorted(listed - public)} unmarked, which it does"
    )


def test_imports_only_go_down_the_floors_and_no_two_rooms_import_each_other():
    floors, _ = house_map()
    order = list(dict.fromkeys(floors.values()))  # top floor first
    height = {room: len(order) - order.index(floor) for room, floor in floors.items()}
    graph = _room_graph()
    upward = sorted(
        f"{a} ({floors[a]}) imports {b} ({floors[b]})"
        for a, targets in graph.items()
        for b in targets
        if a in height and b in height and height[b] > height[a]
    )
    assert not upward, (
        "imports that go up a floor of docs/architecture.md's map: "
        + "; ".join(upward)
        + ". Hand the lower room what it needs, or "
        "move a room to the floor where it belongs"
    )
    loops = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not loops, f"rooms that import each other: {loops}"
