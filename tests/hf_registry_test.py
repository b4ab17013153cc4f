"""nn.hf's families are registered under one name (pure Python: the registry and the sources'
ASTs).

Each HuggingFace family is one file under jax_hybridep/nn/hf/families/ that defines every part of
each `model_type` it describes (config mapping, field aliases, layer prefixes, tensor layouts) in
its `FAMILIES`; the registry, `families.FAMILIES` (`hf.FAMILIES`), imports each file by a plain
import and holds every file's families, and nothing else in the package names a family: no other
module imports a family file or spells a registered model_type.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from jax_hybridep.nn import hf
from jax_hybridep.nn.hf import families
from jax_hybridep.nn.hf.family import Family
from jax_hybridep.nn.hf.tensor_layouts import Fused, Mxfp4, PerExpert, TensorLayout

PACKAGE = pathlib.Path(families.__file__).parents[3]  # the jax_hybridep/ folder
FOLDER = pathlib.Path(families.__file__).parent
TABLE = FOLDER / "__init__.py"


def _family_files() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.py") if p.name != "__init__.py")


def _module(name: str):
    return getattr(families, name)  # the registry imports every family file


def _statically_imported(path: pathlib.Path) -> list[str]:
    """The family files `from jax_hybridep.nn.hf.families import ...` names in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == families.__name__
        for alias in node.names
    ]


def test_every_family_file_is_imported_by_the_registry_once():
    imported = _statically_imported(TABLE)
    files = _family_files()
    assert sorted(imported) == files, (
        f"family files the registry does not import: {sorted(set(files) - set(imported))}; "
        f"imports without a file: {sorted(set(imported) - set(files))}"
    )
    registered = [id(f) for f in families.FAMILIES.values()]
    defined = [id(f) for name in files for f in _module(name).FAMILIES]
    assert sorted(registered) == sorted(defined), "a family file's FAMILIES is not registered"


def test_the_registry_refuses_a_file_twice_and_a_model_type_twice():
    with pytest.raises(ValueError, match="lists .*mixtral more than once"):
        families._registry(families.mixtral, families.dbrx, families.mixtral)
    copy = type("copy", (), {"FAMILIES": families.mixtral.FAMILIES, "__name__": "copy"})
    with pytest.raises(ValueError, match="model_type 'mixtral' is registered twice"):
        families._registry(families.mixtral, copy)


def test_a_family_has_no_optional_part():
    """Every `Family` field is given by each family file (none falls back to a default)."""
    defaulted = [
        f.name
        for f in dataclasses.fields(Family)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert not defaulted, f"Family fields with a default: {defaulted}"


def _problems(family) -> list[str]:
    """What is missing or malformed in one registered family's parts."""
    if not isinstance(family, Family):
        return [f"{family!r} is not a Family"]
    out = []
    if not isinstance(family.model_type, str) or not family.model_type:
        out.append(f"model_type {family.model_type!r} is not a non-empty str")
    for part in ("settings", "layer_prefixes"):
        if not callable(getattr(family, part)):
            out.append(f"{part} is not callable")
    layouts = family.layouts
    if not isinstance(layouts, tuple) or not layouts:
        out.append(f"layouts {layouts!r} is not a non-empty tuple")
    else:
        for layout in layouts:
            if not isinstance(layout, TensorLayout):
                out.append(f"layout {layout!r} is not a TensorLayout")
            elif (
                not layout.router
                or not layout.experts
                or not all(
                    isinstance(s, PerExpert | Fused | Mxfp4) for s in layout.experts.values()
                )
            ):
                out.append(f"layout {layout.name!r} lacks a router or expert sources")
    aliases = family.aliases
    if not isinstance(aliases, tuple) or not all(
        isinstance(g, tuple) and len(g) >= 2 and all(isinstance(n, str) for n in g) for g in aliases
    ):
        out.append(f"aliases {aliases!r} are not groups (tuples) of two or more names")
    else:
        names = [n for g in aliases for n in g]
        if len(names) != len(set(names)):
            out.append(f"aliases {aliases!r} name a field in two groups")
    return out


def test_every_family_file_defines_every_part():
    problems = []
    for name in _family_files():
        defined = getattr(_module(name), "FAMILIES", None)
        if not isinstance(defined, tuple) or not defined:
            problems.append(f"{name}.py: FAMILIES is not a non-empty tuple of Family")
            continue
        for family in defined:
            problems += [f"{name}.py, {family.model_type!r}: {p}" for p in _problems(family)]
    assert not problems, "\n".join(problems)


def test_the_registry_is_what_nn_hf_knows():
    assert hf.FAMILIES is families.FAMILIES
    for model_type, found in families.FAMILIES.items():
        assert found.model_type == model_type and families.family(model_type) is found
    layouts = [layout for f in families.FAMILIES.values() for layout in f.layouts]
    assert set(map(id, families.ALL_LAYOUTS)) == set(map(id, layouts))


def _strings_and_imports(path: pathlib.Path):
    """(every str constant, every module imported) of a source file."""
    tree = ast.parse(path.read_text(), str(path))
    strings, imports = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
        elif isinstance(node, ast.Import):
            imports.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imports.add(node.module)
            imports.update(f"{node.module}.{alias.name}" for alias in node.names)
    return strings, imports


def test_nothing_outside_a_family_file_names_the_family():
    """A registered model_type is spelled only in its own family file, and family files are
    imported only by the registry: no `if name == "mixtral"` branch elsewhere."""
    home = {f.model_type: name for name in _family_files() for f in _module(name).FAMILIES}
    modules = {f"{families.__name__}.{name}" for name in _family_files()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        strings, imports = _strings_and_imports(path)
        for model_type in sorted(strings & set(home)):
            if path != FOLDER / f"{home[model_type]}.py":
                found.append(f"{rel} spells model_type {model_type!r}")
        if path != TABLE:
            found += [f"{rel} imports {m}" for m in sorted(imports & modules)]
    assert not found, "\n".join(found)
