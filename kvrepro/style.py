"""One colour and marker per KV format / mode, for every chart of the notebooks and ``docs/capacity.png``.

Formats (``'bf16'``, ``'fp8'``, ``'k4v4'``, ...) and the vLLM modes that serve them (``'kvrepro:k4v4'``, ...) map to
the same style, so a format looks the same in 01's bar charts, 02's capacity chart and 03's plots. Colours are
seaborn's "deep" palette.
"""
from __future__ import annotations

STYLE = {
    "bf16": ("#4c72b0", "o"), "fp8": ("#dd8452", "s"), "kvrepro:k8v4": ("#55a868", "^"),
    "kvrepro:k4v4": ("#c44e52", "D"), "kvrepro:k4v2": ("#8172b3", "v"), "kvrepro:k5v4": ("#937860", "P"),
}
_EXTRA_STYLES = [("#da8bc3", "X"), ("#8c8c8c", "h"), ("#ccb974", "p"), ("#64b5cd", "<")]


def _style(mode: str, i: int):
    return STYLE.get(mode) or _EXTRA_STYLES[i % len(_EXTRA_STYLES)]


def _mode_of(name: str) -> str:
    """The mode key of :data:`STYLE` for a format or mode name: 'k4v4' and 'kvrepro:k4v4' -> 'kvrepro:k4v4'."""
    name = str(name)
    if name in STYLE:
        return name
    if f"kvrepro:{name}" in STYLE:
        return f"kvrepro:{name}"
    return name


def style_of(name: str, i: int = 0) -> tuple[str, str]:
    """(colour, marker) of a format ('bf16', 'fp8', 'k4v4', ...) or mode ('kvrepro:k4v4', ...): the one palette of
    every chart in the notebooks and docs/capacity.png; unknown names take extra styles by position ``i``."""
    return _style(_mode_of(name), i)


def palette(names) -> dict:
    """{name: colour} for seaborn's ``palette=`` over formats or modes (see :func:`style_of`)."""
    return {n: style_of(n, i)[0] for i, n in enumerate(dict.fromkeys(map(str, names)))}


def markers(names) -> dict:
    """{name: marker} for seaborn's ``markers=`` over formats or modes (see :func:`style_of`)."""
    return {n: style_of(n, i)[1] for i, n in enumerate(dict.fromkeys(map(str, names)))}


MISSING = "–"  # the one marker of a missing value in the notebooks' tables


def formatted(v, fmt: str = "{}", scale: float = 1) -> str:
    """One markdown-table cell: ``fmt.format(v x scale)`` (``scale`` 100 for a fraction shown as a percentage), or ""
    for a missing value (None, NaN, pd.NA): the generated README and report tables leave missing cells blank."""
    import pandas as pd

    if v is None or (not isinstance(v, (list, tuple, dict)) and pd.isna(v)):
        return ""
    return fmt.format(v * scale if scale != 1 else v)


def cell_text(v, digits: int = 3) -> str:
    """One table cell as text: integers (and integer-valued floats) without decimals, other floats to ``digits``
    decimals without trailing zeros, every missing value (None, NaN, pd.NA, NaT) as :data:`MISSING`, newlines in
    text as a visible ⏎."""
    import numbers

    try:
        import pandas as pd
        if not isinstance(v, (list, tuple, dict)) and pd.isna(v):
            return MISSING
    except (TypeError, ValueError):
        pass
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, numbers.Integral):
        return f"{int(v):d}"
    if isinstance(v, numbers.Real):
        f = float(v)
        if f.is_integer() and abs(f) < 1e15:
            return f"{int(f):d}"
        return f"{f:.{digits}f}".rstrip("0").rstrip(".")
    return str(v).replace("\r\n", "\n").replace("\n", " ⏎ ")
