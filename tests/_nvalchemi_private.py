"""Find the private nvalchemi members a source file touches, by attribute name.

Imports alone do not show a private member: ``engine._state`` or
``getattr(batch, "_neighbor_list_cutoff")`` reads one through a public object.
This scanner reads attribute names instead, with a rule that cannot flag the
package's own private attributes:

* nvalchemi's private names are read from its installed source: members its
  classes define or use on ``self`` (methods, class attributes, ``self._x``,
  ``getattr(self, "_x")``), attributes it sets on other objects
  (``batch._x = ...``, ``getattr/setattr/hasattr/delattr(obj, "_x")``, the
  instance dict: ``obj.__dict__.get("_x")``, ``vars(obj)["_x"]``), names held
  in ``_X_ATTR = "_x"`` constants, and its modules' private functions, classes
  and constants. The package's code is read for the same forms.
* ``self._x`` (and ``super()._x``, ``cls._x``, a class-body ``_x``) inside one
  of the package's classes is nvalchemi's only when the class derives from an
  nvalchemi class whose own source (along its MRO) defines or uses ``_x``;
  otherwise it is the package's attribute.
* ``obj._x`` on a name bound to an nvalchemi module or member (``from
  nvalchemi... import``, ``import_quietly("nvalchemi...")``) is nvalchemi's
  when ``_x`` is one of its names; on a name bound to one of the package's
  own modules or members it is the package's.
* ``obj._x`` on any other receiver is nvalchemi's when ``_x`` is one of its
  names, no class of the package defines ``_x`` for itself, and
  ``torch.nn.Module`` does not either (``_modules`` is torch's). A name both
  libraries define is ambiguous on such a receiver and not judged:
  :func:`ambiguous_names` lists them.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GETATTR_FAMILY = {"getattr", "hasattr", "setattr", "delattr"}


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` and ``_`` are not."""
    dunder = name.startswith("__") and name.endswith("__")
    return len(name) > 1 and name.startswith("_") and not dunder


@dataclass(frozen=True)
class Access:
    """One use of a private attribute name in a source file."""

    path: Path
    line: int
    name: str
    receiver: str  # source of the object, "class body" for a definition
    owner: str | None  # the package class it is used in, if any

    def __str__(self) -> str:
        where = f" (in {self.owner})" if self.owner else ""
        return f"{self.path.name}:{self.line}: {self.receiver}.{self.name}{where}"


def _string_argument(node: ast.Call) -> str | None:
    """``"_x"`` of ``getattr(obj, "_x", ...)`` and friends, else None."""
    if (
        getattr(node.func, "id", None) in GETATTR_FAMILY
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _instance_dict_of(node: ast.expr) -> ast.expr | None:
    """``obj`` of ``obj.__dict__`` and of ``vars(obj)``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "vars"
        and len(node.args) == 1
    ):
        return node.args[0]
    return None


def keyed_access(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``(obj, "_x")`` of an attribute reached by its name as a string.

    ``getattr/hasattr/setattr/delattr(obj, "_x")`` and the instance dict:
    ``obj.__dict__["_x"]``, ``obj.__dict__.get("_x")`` (``pop``,
    ``setdefault``), ``vars(obj)["_x"]``.
    """
    if isinstance(node, ast.Call) and node.args:
        string = _string_argument(node)
        if string is not None:
            return node.args[0], string
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in ("get", "pop", "setdefault")
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            owner = _instance_dict_of(func.value)
            if owner is not None:
                return owner, node.args[0].value
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        owner = _instance_dict_of(node.value)
        if owner is not None:
            return owner, node.slice.value
    return None


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object a class's own code is on."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "super"
        and not node.args
    )


def _class_body_names(node: ast.ClassDef) -> Iterator[str]:
    """Names a class body defines directly (methods, attributes)."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield item.name
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    yield target.id
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            yield item.target.id


def _own_names(tree: ast.AST) -> set[str]:
    """Private names code uses on its own object: class body, ``self._x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.update(_class_body_names(node))
        elif isinstance(node, ast.Attribute) and _is_self(node.value):
            names.add(node.attr)
        else:
            keyed = keyed_access(node)
            if keyed is not None and _is_self(keyed[0]):
                names.add(keyed[1])
    return {name for name in names if is_private(name)}


def _module_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if is_private(name)}


def _names_set_on_others(tree: ast.AST) -> set[str]:
    """Private attributes code sets or probes on objects other than itself."""
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and not _is_self(node.value)
        ):
            names.add(node.attr)
        else:
            keyed = keyed_access(node)
            if keyed is not None:
                names.add(keyed[1])
    return {name for name in names if is_private(name)}


def _attribute_name_constants(tree: ast.Module) -> set[str]:
    """Private attribute names held in module constants (``_X_ATTR = "_x"``).

    nvalchemi sets some attributes through such a constant
    (``setattr(batch, _PIPELINE_NEIGHBOR_SOURCES_ATTR, ...)``).
    """
    names = set()
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            and node.value.value.isidentifier()
            and any(
                isinstance(t, ast.Name) and t.id.endswith("_ATTR") for t in node.targets
            )
        ):
            names.add(node.value.value)
    return {name for name in names if is_private(name)}


@functools.cache
def nvalchemi_names() -> frozenset[str]:
    """Every private member name nvalchemi's installed source defines or uses."""
    import nvalchemi

    root = Path(nvalchemi.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names |= _own_names(tree) | _names_set_on_others(tree)
        names |= _module_level_names(tree) | _attribute_name_constants(tree)
    return frozenset(names)


@functools.cache
def class_names(cls: type) -> frozenset[str]:
    """Private names nvalchemi classes along ``cls``'s MRO define or use on self."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("nvalchemi."):
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):  # pragma: no cover - no source for it
            continue
        names |= _own_names(ast.parse(textwrap.dedent(source)))
    return frozenset(names)


@functools.cache
def torch_module_names() -> frozenset[str]:
    """Private attributes of ``torch.nn.Module``: torch's, not nvalchemi's."""
    import torch

    names = set(vars(torch.nn.Module())) | set(dir(torch.nn.Module))
    return frozenset(name for name in names if is_private(name))


class PackageScan:
    """The package's files, their classes and what derives from nvalchemi."""

    def __init__(self, package: Path, skip: tuple[str, ...] = ()) -> None:
        self.root = package.parent
        self.trees = {
            self._module_name(path): (path, ast.parse(path.read_text()))
            for path in sorted(package.rglob("*.py"))
            if path.name not in skip
        }

    def _module_name(self, path: Path) -> str:
        parts = path.relative_to(self.root).with_suffix("").parts
        return ".".join(parts).removesuffix(".__init__")

    # -- which names a file binds, and to what ---------------------------------

    @functools.cache  # noqa: B019 - one scan per test session
    def bindings(self, module: str) -> dict[str, tuple[str, ...]]:
        """Names bound in ``module`` (anywhere): what they refer to.

        ``("nv", dotted, *attributes)`` for an nvalchemi module or member,
        ``("pkg", module, name)`` for a package member.
        """
        _, tree = self.trees[module]
        bound: dict[str, tuple[str, ...]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    bound[alias.asname or alias.name] = self._origin(
                        node.module, alias.name
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "nvalchemi":
                        key = alias.asname or alias.name.split(".")[0]
                        target = alias.name if alias.asname else "nvalchemi"
                        bound[key] = ("nv", target)
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value:
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                origin = self.expression_origin(node.value, bound)
                for target in targets:
                    if isinstance(target, ast.Name) and origin is not None:
                        bound[target.id] = origin
            elif isinstance(node, ast.ClassDef):
                bound.setdefault(node.name, ("pkg", module, node.name))
        return bound

    @staticmethod
    def _origin(module: str, name: str) -> tuple[str, ...]:
        if module.split(".")[0] == "nvalchemi":
            return ("nv", module, name)
        return ("pkg", module, name)

    @staticmethod
    def expression_origin(
        node: ast.expr, bound: dict[str, tuple[str, ...]]
    ) -> tuple[str, ...] | None:
        """``import_quietly("nvalchemi.x").Y`` or ``alias.Y`` of an nvalchemi name."""
        attributes: list[str] = []
        while isinstance(node, ast.Attribute):
            attributes.insert(0, node.attr)
            node = node.value
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "import_quietly"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] == "nvalchemi"
        ):
            return ("nv", str(node.args[0].value), *attributes)
        if isinstance(node, ast.Name) and bound.get(node.id, ("",))[0] == "nv":
            return (*bound[node.id], *attributes)
        return None

    # -- which classes derive from nvalchemi ----------------------------------

    @functools.cache  # noqa: B019 - one scan per test session
    def nvalchemi_bases(self, module: str, name: str) -> frozenset[type]:
        """The nvalchemi classes a package class derives from (transitively)."""
        return self._bases_of(module, name, frozenset())

    def _bases_of(
        self, module: str, name: str, seen: frozenset[tuple[str, str]]
    ) -> frozenset[type]:
        if (module, name) in seen or module not in self.trees:
            return frozenset()
        seen = seen | {(module, name)}
        _, tree = self.trees[module]
        found: set[type] = set()
        classes = [
            n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name
        ]
        if not classes:  # a re-export: follow the import
            origin = self.bindings(module).get(name)
            return self._resolve(origin, seen) if origin else frozenset()
        for node in classes:
            for base in node.bases:
                origin = self.expression_origin(base, self.bindings(module))
                if origin is None and isinstance(base, ast.Name):
                    origin = self.bindings(module).get(base.id)
                if origin is not None:
                    found |= self._resolve(origin, seen)
        return frozenset(found)

    def _resolve(
        self, origin: tuple[str, ...], seen: frozenset[tuple[str, str]]
    ) -> frozenset[type]:
        if origin[0] == "pkg":
            if (origin[1], origin[2]) in seen:
                return frozenset()
            return self._bases_of(origin[1], origin[2], seen)
        target = _import_member(origin[1], origin[2:])
        return frozenset({target}) if isinstance(target, type) else frozenset()

    # -- the package's own names ---------------------------------------------

    @functools.cached_property
    def own_names(self) -> frozenset[str]:
        """Private names the package's classes define for themselves.

        Members a class inherits from nvalchemi are not its own; module-level
        names are judged by the receiver's binding instead.
        """
        names: set[str] = set()
        for module, (_, tree) in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    inherited = set()
                    for base in self.nvalchemi_bases(module, node.name):
                        inherited |= class_names(base)
                    names |= _own_names(node) - inherited
        return frozenset(names)

    # -- the check ---------------------------------------------------------

    def accesses(self) -> Iterator[Access]:
        """Every use of one of nvalchemi's private names by the scanned files."""
        nv_names = nvalchemi_names()
        judged = nv_names - self.own_names - torch_module_names()
        for module, (path, tree) in self.trees.items():
            context = _Context(path, self.bindings(module), judged, nv_names)
            yield from self._accesses_in(module, tree, context, None, set())

    def _accesses_in(
        self,
        module: str,
        node: ast.AST,
        context: _Context,
        owner: str | None,
        inherited: set[str],
    ) -> Iterator[Access]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                names: set[str] = set()
                for base in self.nvalchemi_bases(module, child.name):
                    names |= class_names(base)
                yield from (
                    Access(context.path, child.lineno, name, "class body", child.name)
                    for name in _class_body_names(child)
                    if name in names and is_private(name)
                )
                yield from self._accesses_in(module, child, context, child.name, names)
                continue
            yield from _node_accesses(child, context, owner, inherited)
            yield from self._accesses_in(module, child, context, owner, inherited)


@dataclass(frozen=True)
class _Context:
    """What judging one file's accesses needs."""

    path: Path
    bindings: dict[str, tuple[str, ...]]
    judged: frozenset[str]  # nvalchemi's names on a receiver of unknown kind
    nv_names: frozenset[str]  # all of nvalchemi's names


def _node_accesses(
    node: ast.AST, context: _Context, owner: str | None, inherited: set[str]
) -> Iterator[Access]:
    if isinstance(node, ast.Attribute):
        receiver, name = node.value, node.attr
    else:
        keyed = keyed_access(node)
        if keyed is None:
            return
        receiver, name = keyed
    if not is_private(name):
        return
    if _is_self(receiver) and owner is not None:
        names: set[str] | frozenset[str] = inherited
    elif PackageScan.expression_origin(receiver, context.bindings) is not None:
        names = context.nv_names  # an nvalchemi module or member, by its binding
    elif isinstance(receiver, ast.Name) and receiver.id in context.bindings:
        names = frozenset()  # one of the package's modules or members
    else:
        names = context.judged
    if name in names:
        yield Access(context.path, node.lineno, name, ast.unparse(receiver), owner)


def ambiguous_names(scan: PackageScan) -> frozenset[str]:
    """Names both nvalchemi and the package define (not judged on other objects)."""
    return nvalchemi_names() & scan.own_names


def _import_member(module: str, attributes: tuple[str, ...]) -> object:
    """``module.a.b`` for ``attributes`` ``("a", "b")``; None when missing."""
    from nvalchemi_ase._quiet import import_quietly

    target: object = import_quietly(module)
    for attribute in attributes:
        try:
            target = getattr(target, attribute)
        except AttributeError:
            try:
                target = importlib.import_module(f"{module}.{attribute}")
            except ImportError:
                return None
            module = f"{module}.{attribute}"
    return target
