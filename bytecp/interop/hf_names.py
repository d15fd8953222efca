"""The state's tensor names matched with a Hugging Face directory's, as
transformers matches them.

Called by the load pipeline's match phase (every rank, each on its own
target tree, the same answer everywhere since the names are the same) when
the opened checkpoint is a foreign source
(:attr:`bytecp.loading.opened.OpenedCheckpoint.foreign`); the answer renames
the source's tensors to the target's names before the ordinary matching.

The rules, in order:

1. **The state's own prefix.** ``bytecp.load(dir, {"model": model})`` names
   the model's tensors ``model.<name>``; leading name components common to
   the state are dropped (as many as make the most names match, fewest first).
2. **The base-model prefix.** transformers loads a ``LlamaForCausalLM``
   file (``model.layers.0...``, ``lm_head.weight``) into a ``LlamaModel``
   (``layers.0...``) and the other way round: a one-component prefix
   (``model.``, ``transformer.``) present on one side only is added or
   stripped, whichever makes the most names match.
3. **Tied weights.** A target whose tensors share memory (``lm_head.weight``
   tied to ``embed_tokens.weight``) is filled once from whichever name the
   file has (the ordinary tie handling of
   :mod:`bytecp.loading.matching`). When the directory's ``config.json``
   says ``tie_word_embeddings: true``, an untied target ``*lm_head.weight``
   the file lacks reads the file's input embedding (``embed_tokens.weight``,
   ``wte.weight``, ``word_embeddings.weight``), as transformers ties it
   after loading (``save_pretrained`` of a tied model drops it); otherwise
   it is missing, as it is for transformers.

With ``strict`` (the default), names still unmatched are one
:class:`~bytecp.errors.StateMismatchError` line listing a few of each side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from bytecp.errors import StateMismatchError
from bytecp.tree.state import FlatTree

__all__ = ["NameMatch", "match_names"]

_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


@dataclasses.dataclass
class NameMatch:
    """File name -> target name (renames), and target name -> file name read for it as well (ties)."""

    renames: dict[str, str]
    aliases: dict[str, str]


def _strip(name: str, k: int) -> str | None:
    parts = name.split(".")
    return ".".join(parts[k:]) if len(parts) > k else None


def _find(x: str, prefix: str, files: Collection[str]) -> str | None:
    if x in files:
        return x
    if prefix:
        if prefix + x in files:
            return prefix + x
        if x.startswith(prefix) and x[len(prefix):] in files:
            return x[len(prefix):]
    return None


def _best(names: list[str], files: Collection[str]) -> dict[str, str]:
    """Target name -> file name under the (state prefix, base prefix) rule matching the most names."""
    best: dict[str, str] = {}
    split = [n.split(".") for n in names]
    common = 0  # leading components every target name shares (the state's own prefix)
    while split and all(len(p) > common + 1 and p[common] == split[0][common] for p in split):
        common += 1
    for k in range(common + 1):
        stripped = {n: _strip(n, k) for n in names}
        prefixes = {""} | {f.split(".", 1)[0] + "." for f in files if "." in f}
        prefixes |= {x.split(".", 1)[0] + "." for x in stripped.values() if x and "." in x}
        for p in sorted(prefixes, key=lambda p: (p != "", p)):
            got = {}
            for n, x in stripped.items():
                f = _find(x, p, files) if x is not None else None
                if f is not None:
                    got[n] = f
            if len(got) > len(best):
                best = got
    return best


def match_names(
    target: FlatTree, files: Mapping[str, object], *, tied: bool, strict: bool, where: str
) -> NameMatch:
    """(every rank of a foreign load) The renames and ties that make
    ``target``'s names read the file's tensors (module docstring)."""
    names = [*target.tensors, *target.aliases]
    found = _best(names, files)
    renames: dict[str, str] = {}
    for n, f in found.items():
        renames.setdefault(f, n)
    aliases = {n: renames[f] for n, f in found.items() if renames[f] != n}
    groups = {n: n for n in target.tensors} | dict(target.aliases)
    done = {groups[n] for n in found}
    for n in target.tensors:
        if not tied or n in done or not n.endswith("lm_head.weight"):
            continue
        emb = next((f for f in sorted(files) if f.endswith(_EMBEDDINGS)), None)
        if emb is not None:
            renames.setdefault(emb, emb)
            aliases[n] = renames[emb]
            done.add(n)
    missing = [n for n in target.tensors if n not in done]
    unexpected = sorted(set(files) - set(renames))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the state's {_few(missing)} are not in it")
        if unexpected:
            parts.append(f"its {_few(unexpected)} are not in the state")
        raise StateMismatchError(
            f"state does not match the Hugging Face checkpoint at {where}: {'; '.join(parts)} "
            "(names are matched up to the state's prefix and a base-model prefix such as 'model.'; "
            "pass strict=False to load the names that match)"
        )
    return NameMatch(renames, aliases)


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(repr(k) for k in names[:n])
    return f"{len(names)} tensor(s) {shown}{', ...' if len(names) > n else ''}"
