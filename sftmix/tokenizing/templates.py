"""Chat templates: the reference's 21 named ones (carried), the tokenizer's own, and .jinja files.

Rendering mirrors ``transformers.apply_chat_template(tokenize=False)`` as the reference runs it
(transformers 5.4): a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` that does not escape HTML, ``raise_exception`` and
``strftime_now``, and the tokenizer's named special tokens as template variables. Owning the renderer
keeps compat bytes stable when transformers changes its message normalisation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import cache, lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import BuiltinMethodType
from typing import Any, cast

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sftmix.config.config import NAMED_TEMPLATES
from sftmix.errors import TemplateError

logger = logging.getLogger(__name__)


TOKENIZER_TEMPLATE = "tokenizer"


def _carried(name: str) -> Traversable:
    return resources.files(__package__).joinpath("templates", f"{name}.jinja")


def named_template_file(name: str) -> str:
    """Where a template we carry is installed (its ``.jinja`` file in our package's ``templates/``)."""
    return str(_carried(name))


@cache
def named_template(name: str) -> str:
    """The exact text of a template we carry."""
    return _carried(name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _carried_texts() -> frozenset[str]:
    return frozenset(named_template(n) for n in NAMED_TEMPLATES)


def template_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ResolvedTemplate:
    """The template text actually used, and how the user named it (recorded in the statistics)."""

    text: str
    label: str | None
    source: str

    @property
    def sha256(self) -> str:
        return template_sha256(self.text)


def _own_template(own: str | dict[str, str] | None, tokenizer_name: str) -> str:
    if isinstance(own, dict):
        own = own.get("default")
    if not own:
        raise TemplateError(
            f"tokenizer {tokenizer_name!r} has no chat_template; name one with --chat_template_name "
            f"({', '.join(NAMED_TEMPLATES)}) or give a .jinja file"
        )
    return own


def read_template_file(path: str) -> str:
    """The text of a ``.jinja`` chat template file (the command reads it before a Prefect API starts)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(f"cannot read chat template file {path!r}: {exc.strerror or exc}") from None


def did_you_mean(name: str, lead: str) -> str:
    """``lead`` and the carried template names closest to ``name`` (``olmo2`` -> ``olmo``), or nothing."""
    import difflib

    close = difflib.get_close_matches(name, NAMED_TEMPLATES, n=3, cutoff=0.6)
    return f"{lead}{' or '.join(repr(c) for c in close)}?" if close else ""


#: Unknown template names already warned about in this process.
_FALLBACKS_WARNED: set[str] = set()


def is_unknown_template(name: str | None) -> bool:
    """A name that is none of ours, not the tokenizer's own and not a ``.jinja`` file."""
    if not name:
        return False
    return name not in NAMED_TEMPLATES and name != TOKENIZER_TEMPLATE and not name.endswith(".jinja")


def _unknown_template_error(name: str) -> TemplateError:
    return TemplateError(
        f"unknown chat template {name!r}{did_you_mean(name, '; did you mean ')}: use one of "
        f"{', '.join(NAMED_TEMPLATES)}, '{TOKENIZER_TEMPLATE}' for the tokenizer's own template, or a "
        "path to a .jinja file"
    )


def check_template_name(name: str | None, unknown: str) -> None:
    """At once, before the tokenizer loads: refuse an unknown name (``unknown: error``), or say first that
    the tokenizer's own template will be used for it (``fallback``, the reference's behaviour)."""
    if not is_unknown_template(name):
        return
    assert name is not None
    if unknown != "fallback":
        raise _unknown_template_error(name)
    if name not in _FALLBACKS_WARNED:  # the command checks ahead of the plan: one warning
        _FALLBACKS_WARNED.add(name)
        logger.warning(
            "UNKNOWN CHAT TEMPLATE %r%s: the tokenizer's own chat_template is used instead, as the reference "
            "converter does (tokenizer.unknown_template: error, or convert's --unknown_template error, refuses "
            "the run). Known names: %s.",
            name,
            did_you_mean(name, ", did you mean "),
            ", ".join(NAMED_TEMPLATES),
        )


def resolve_template(
    name: str | None,
    own: str | dict[str, str] | None,
    tokenizer_name: str,
    unknown: str = "error",
    add_bos: bool = False,
    bos_token: str | None = None,
) -> ResolvedTemplate:
    """Pick the template text for ``name``; ``own`` is the tokenizer's own chat_template."""
    if name in NAMED_TEMPLATES:
        text, source = named_template(name), f"tokenize-mixer:{name}"
    elif name is None or name in ("", TOKENIZER_TEMPLATE):
        text, source = _own_template(own, tokenizer_name), f"tokenizer:{tokenizer_name}"
    elif name.endswith(".jinja"):
        text, source = read_template_file(name), f"file:{name}"
    else:
        check_template_name(name, unknown)  # refuses, or warns once
        text = _own_template(own, tokenizer_name)
        source = f"tokenizer:{tokenizer_name} (unknown name {name!r}{did_you_mean(name, ', did you mean ')})"
    if add_bos:
        if text.startswith("{{ bos_token }}") or (bos_token is not None and text.startswith(bos_token)):
            raise TemplateError("add_bos is set, but the chat template already starts with the bos token")
        text = "{{ bos_token }}" + text
    return ResolvedTemplate(text=text, label=name, source=source)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


#: ``{% generation %}`` ... ``{% endgeneration %}``: the text a template marks as the model's own.
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(text: str) -> bool:
    return GENERATION_TAG.search(text) is not None


class _GenerationTracker(jinja2.ext.Extension):
    """The ``generation`` block of transformers' chat templates: renders its body unchanged and, while
    a span-recording render is under way, records the body's character span in the output."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        environment.extend(generation_state=threading.local())

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_generation"), [], [], body).set_lineno(lineno)

    def _render_generation(self, caller: Any) -> str:
        text = caller()
        state = self.environment.generation_state  # type: ignore[attr-defined]  # added by extend() in __init__
        chunks = getattr(state, "chunks", None)
        if chunks is not None:  # every chunk before this block has been yielded and collected
            start = sum(len(c) for c in chunks)
            state.spans.append((start, start + len(text)))
        return text


class _BuiltinCallContext(jinja2.runtime.Context):
    """Jinja's context, calling a built-in method (``message.get(...)``, the commonest call in chat
    templates) without first looking for the markers that ask Jinja to pass it the context: a built-in
    has none. The rest is Jinja's own ``call``."""

    def call(__self, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        if type(__obj) is not BuiltinMethodType:
            return super().call(__obj, *args, **kwargs)
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:
            return __self.environment.undefined(
                "value was undefined because a callable raised a StopIteration exception"
            )


def _select_or_reject(
    context: jinja2.runtime.Context,
    value: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modfunc: Callable[[Any], Any],
    lookup_attr: bool,
) -> Iterator[Any]:
    """``jinja2.filters.select_or_reject`` with the test looked up once per filter, not once per item:
    Jinja's per-item ``call_test`` was ~40% of rendering the olmo templates, whose every render runs
    ``messages|selectattr('role', 'equalto', 'system')``. A test that takes a context, environment or
    eval context, or a name that is not a test, is left to Jinja's own code (its errors included)."""
    if value:
        func = _selecting(context, args, kwargs, modfunc, lookup_attr)
        for item in value:
            if func(item):
                yield item


def _selecting(
    context: jinja2.runtime.Context,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modfunc: Callable[[Any], Any],
    lookup_attr: bool,
) -> Callable[[Any], Any]:
    off = 1 if lookup_attr else 0
    test: Callable[..., Any] | None = None
    if len(args) > off:
        try:
            # (Jinja annotates its tests as "function", which mypy will not call)
            test = cast("Callable[..., Any] | None", context.environment.tests.get(args[off]))
        except TypeError:  # an unhashable name: Jinja raises it at the first item
            test = None
    if test is None or hasattr(test, "jinja_pass_arg"):  # (Jinja's mark of a test given a context)
        return jinja2.filters.prepare_select_or_reject(context, args, kwargs, modfunc, lookup_attr)
    rest = args[1 + off :]
    if not lookup_attr:
        return lambda item: modfunc(test(item, *rest, **kwargs))
    attribute = jinja2.filters.make_attrgetter(context.environment, args[0])
    return lambda item: modfunc(test(attribute(item), *rest, **kwargs))


def _selection_filter(modfunc: Callable[[Any], Any], lookup_attr: bool) -> Callable[..., Iterator[Any]]:
    @jinja2.pass_context
    def selection(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _select_or_reject(context, value, args, kwargs, modfunc, lookup_attr)

    return selection


#: Jinja's four selection filters, each with its own ``modfunc`` and ``lookup_attr`` as Jinja's has.
_SELECTION_FILTERS = {
    "select": _selection_filter(lambda x: x, False),
    "reject": _selection_filter(lambda x: not x, False),
    "selectattr": _selection_filter(lambda x: x, True),
    "rejectattr": _selection_filter(lambda x: not x, True),
}


@lru_cache(maxsize=16)
def compile_template(text: str, trusted: bool = False) -> jinja2.Template:
    """Compile with transformers' settings; ``trusted`` (templates we carry) skips the sandbox's
    per-attribute checks, which cost more than the rendering itself and change no output, and calls
    built-in methods directly (``_BuiltinCallContext``; tests/test_templates.py renders both ways)."""
    options: dict = {
        "trim_blocks": True,
        "lstrip_blocks": True,
        "extensions": [jinja2.ext.loopcontrols, _GenerationTracker],
    }
    env = jinja2.Environment(**options) if trusted else ImmutableSandboxedEnvironment(**options)
    if trusted:
        env.context_class = _BuiltinCallContext
    env.filters["tojson"] = _tojson
    env.filters.update(_SELECTION_FILTERS)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from None


class ChatRenderer:
    """Renders conversations with one compiled template and the tokenizer's special tokens."""

    def __init__(self, template_text: str, special_tokens: dict[str, str]) -> None:
        self._template = compile_template(template_text, trusted=template_text in _carried_texts())
        self._special_tokens = dict(special_tokens)

    def render(self, messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )

    def render_with_generation_spans(
        self, messages: list[dict[str, Any]], tools: list | None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The full render and the character spans of its ``{% generation %}`` blocks."""
        state = self._template.environment.generation_state  # type: ignore[attr-defined]  # _GenerationTracker adds it
        state.chunks, state.spans = [], []
        try:
            for chunk in self._template.generate(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=False,
                **self._special_tokens,
            ):
                state.chunks.append(chunk)
            return "".join(state.chunks), list(state.spans)
        finally:
            state.chunks = state.spans = None


#: Lines of unified diff kept when the template used differs from the tokenizer's own.
DRIFT_DIFF_LINES = 40


def template_drift(used: str, source: str, shipped: str | dict[str, str] | None) -> dict[str, Any]:
    """The template an output was made with against the one its tokenizer ships for the model: a
    model evaluated (or served) with a different template sees prompts it was not trained on.

    ``shipped`` is ``none`` (the tokenizer has no template: only ``tokenizer/`` of the output carries
    one), ``same`` or ``differs`` (with a unified diff excerpt, shipped -> used)."""
    import difflib

    if isinstance(shipped, dict):
        shipped = shipped.get("default")
    drift: dict[str, Any] = {"source": source, "used_sha256": template_sha256(used), "shipped": "none"}
    if not shipped:
        return drift
    drift["shipped_sha256"] = template_sha256(shipped)
    if shipped == used:
        drift["shipped"] = "same"
        return drift
    diff = list(
        difflib.unified_diff(
            shipped.splitlines(), used.splitlines(), "tokenizer's chat_template", source, n=1, lineterm=""
        )
    )
    drift["shipped"] = "differs"
    drift["diff"] = diff[:DRIFT_DIFF_LINES] + (
        [f"... {len(diff) - DRIFT_DIFF_LINES} more lines"] if len(diff) > DRIFT_DIFF_LINES else []
    )
    return drift
