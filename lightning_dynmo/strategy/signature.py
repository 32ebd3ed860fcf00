"""``DynMoStrategy.__init__``'s visible signature and argument docs, made from :class:`PipelineOptions`.

The constructor takes the options as ``**options`` (so an unknown name fails naming the closest
option), which tools reading signatures cannot see through. :func:`expose_options` gives it an
``inspect.Signature`` with every option as a keyword-only parameter (annotation and default the
dataclass's own) and an ``Args:`` section made from the field docstrings, so ``inspect.signature``,
IDEs and jsonargparse (LightningCLI: ``--trainer.strategy.pipeline_parallel=2``, and ``--help``)
see the options without a second list of them. ``docs/options.md`` is made from the same field
docstrings (:mod:`~lightning_dynmo.strategy.options_doc`).
"""
from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap
import types
import typing
from dataclasses import MISSING, fields
from enum import Enum
from typing import Literal

from .options import PipelineOptions


def with_enum_values(hint):
    """``hint`` where each mode enum ``E`` also admits its values, ``E | Literal[<values>]``: users write
    ``rebalance="never"`` (the dataclass takes the values), while jsonargparse reads an enum by its
    members' names (``NEVER``)."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint | Literal[tuple(m.value for m in hint)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [with_enum_values(a) for a in typing.get_args(hint)])
    return hint


def option_parameters() -> list[inspect.Parameter]:
    """Every option as a keyword-only parameter, in the dataclass's order; an enum default as its
    value (what a config file holds)."""
    hints = typing.get_type_hints(PipelineOptions)
    params = []
    for f in fields(PipelineOptions):
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=with_enum_values(hints[f.name]),
                                        default=default.value if isinstance(default, Enum) else default))
    return params


def field_docs(cls: type = PipelineOptions) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal right after it), as one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def options_args_doc() -> str:
    """An ``Args:`` section (Google style, which docstring parsers read) of the options' docstrings."""
    try:
        docs = field_docs()
    except OSError:  # no source (a frozen or zipped install): the signature still holds
        return ""
    return "\n\nArgs:\n" + "\n".join(f"    {f.name}: {docs.get(f.name, '')}" for f in fields(PipelineOptions))


def expose_options(init):
    """``init`` (``self, <Lightning's arguments>, **options``) with a signature that lists the options
    in place of ``**options``, and their docs appended to its docstring; returns ``init``."""
    own = inspect.signature(init)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    clash = {p.name for p in kept} & {f.name for f in fields(PipelineOptions)}
    if clash:
        raise TypeError(f"{init.__qualname__} names option(s) {sorted(clash)} itself; they belong to PipelineOptions")
    init.__signature__ = own.replace(parameters=kept + option_parameters())
    init.__doc__ = inspect.cleandoc(init.__doc__ or "") + options_args_doc()
    return init
