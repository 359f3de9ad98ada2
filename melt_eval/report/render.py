"""The one renderer: a `Table` (numbers, emphasis, notes) as Markdown, booktabs LaTeX, or a rich table.

The report's tables (`melt_eval.report.tables`) and the memory table (`melt_eval.report.memory`) are built
as `Table`s and printed or written only through here.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field, replace

from melt_eval.report.latex import standalone, tex_escape

NA = "n/a"


def printable(text: str) -> str:
    """`text` with its control characters written as escapes (ESC as \\x1b): a label or a brief read from a
    file must not clear or recolour the terminal, nor break a Markdown row with a newline."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or unicodedata.category(c) == "Zs" else
                   c.encode("unicode_escape").decode("ascii") for c in text)


@dataclass
class Cell:
    value: float | None = None  # in display units (percent, GB, ...)
    stderr: float | None = None
    paper: float | None = None  # the paper's figure, printed beside when the table compares
    digits: int = 1
    text: str | None = None  # literal content instead of a number (e.g. "×4")
    bold: bool = False
    underline: bool = False
    thousands: bool = False  # 196,608 rather than 196608
    footnote: str = ""  # a mark after the value ("*"), explained in the table's notes

    def shown(self) -> str | None:
        if self.text is not None:
            return self.text
        return None if self.value is None else f"{self.value:{',' if self.thousands else ''}.{self.digits}f}{self.footnote}"

    def rounded(self) -> float | None:
        """The value as printed; emphasis compares these so that printed ties are marked alike."""
        return None if self.value is None else round(self.value, self.digits)


@dataclass
class Row:
    stub: list[str]
    cells: list[Cell]
    rule_before: bool = False
    shaded: bool = False


@dataclass
class Table:
    key: str
    title: str
    caption: str
    stub_heads: list[str]
    heads: list[str]
    rows: list[Row]
    groups: list[tuple[str, int]] = field(default_factory=list)  # spanning headers over the data columns
    notes: list[str] = field(default_factory=list)
    compare: bool = False  # cells carry the paper's figure to print beside ours
    source: str = "results"  # "results", "paper", or anything else (the heading then names no source)


# ------------------------------------------------------------------ rendering


def _printable_table(t: Table) -> Table:
    """`t` with every text escaped by `printable` (its labels and briefs may come from files)."""
    def cell(c: Cell) -> Cell:
        return replace(c, text=None if c.text is None else printable(c.text), footnote=printable(c.footnote))

    return replace(t, title=printable(t.title), caption=printable(t.caption),
                   stub_heads=[printable(h) for h in t.stub_heads], heads=[printable(h) for h in t.heads],
                   groups=[(printable(g), n) for g, n in t.groups], notes=[printable(n) for n in t.notes],
                   rows=[replace(r, stub=[printable(s) for s in r.stub], cells=[cell(c) for c in r.cells])
                         for r in t.rows])


def _diff(c: Cell) -> str:
    """Ours minus the paper's, between the figures as printed (so 26.46 vs 26.5 reads +0.0, not -0.0)."""
    d = round(c.rounded() - c.paper, c.digits) + 0.0  # + 0.0 turns -0.0 into 0.0
    return f"{d:+.{c.digits}f}".replace("-", "\u2212")


def paper_beside(c: Cell) -> str | None:
    """'paper 46.7, Δ +3.3' (or 'paper 46.7' when ours is missing); None when there is nothing to compare."""
    if c.paper is None or c.text is not None:
        return None
    p = f"paper {c.paper:.{c.digits}f}"
    return f"{p}, Δ {_diff(c)}" if c.value is not None else p


def cell_markdown(c: Cell) -> str:
    shown = c.shown()
    if shown is None:
        out = NA
    else:
        out = f"**{shown}**" if c.bold else f"<ins>{shown}</ins>" if c.underline else shown
        if c.stderr is not None:
            out += f" ± {c.stderr:.{c.digits}f}"
    if (beside := paper_beside(c)) is not None:
        out += f" ({beside})"
    return out


def cell_latex(c: Cell) -> str:
    shown = c.shown()
    if shown is None:
        out = NA
    else:
        shown = tex_escape(shown)
        if c.thousands:
            shown = shown.replace(",", "{,}")
        if c.footnote:
            shown = shown.removesuffix(tex_escape(c.footnote)) + f"$^{c.footnote}$"
        out = f"\\textbf{{{shown}}}" if c.bold else f"\\underline{{{shown}}}" if c.underline else shown
        if c.stderr is not None:
            out += f"{{\\tiny\\textcolor{{gray}}{{$\\pm${c.stderr:.{c.digits}f}}}}}"
    if c.paper is not None and c.text is None:
        p = f"{c.paper:.{c.digits}f}"
        beside = f"{p}; ${_diff(c).replace(chr(0x2212), '-')}$" if c.value is not None else p
        out += f" {{\\scriptsize\\textcolor{{gray}}{{[{beside}]}}}}"
    return out


def heading(t: Table) -> str:
    src = {"paper": "the paper's own numbers (no results found)", "results": "reproduced"}.get(t.source)
    return f"{t.title} — {src}" if src else t.title


def render_markdown(t: Table) -> str:
    t = _printable_table(t)
    if t.groups:
        heads, k = [], 0
        for g, span in t.groups:
            heads += [f"{g} {h}" if span > 1 else g for h in t.heads[k : k + span]]
            k += span
    else:
        heads = t.heads
    lines = [f"### {heading(t)}", ""]
    lines.append("| " + " | ".join(t.stub_heads + heads) + " |")
    lines.append("|" + "|".join([":--"] * len(t.stub_heads) + ["--:"] * len(heads)) + "|")
    for r in t.rows:
        stub = [f"**{s}**" if r.shaded and i == 0 else s for i, s in enumerate(r.stub)]
        lines.append("| " + " | ".join(stub + [cell_markdown(c) for c in r.cells]) + " |")
    lines.append("")
    if t.compare:
        lines.append("Each cell: ours (paper's figure, Δ = ours − paper).")
    for n in t.notes:
        lines.append(f"- {n}")
    return "\n".join(lines).rstrip() + "\n"


def render_latex(t: Table) -> str:
    """One booktabs `table` a paper can paste (needs booktabs and xcolor[table])."""
    t = _printable_table(t)
    ns, nd = len(t.stub_heads), len(t.heads)
    out = ["\\begin{table}[t]", "\\centering", "\\small"]
    caption = t.caption
    if t.source == "paper":
        caption += " The paper's own numbers (no results found)."
    if t.compare:
        caption += " Each cell: ours, then [paper; ours $-$ paper]."
    notes = " ".join(tex_escape(n).replace("*", "$^*$") for n in t.notes)
    out.append(f"\\caption{{{caption} {notes}}}".replace(" }", "}"))
    out.append(f"\\label{{tab:{t.key}}}")
    out.append("\\begin{tabular}{" + "l" * ns + "c" * nd + "}")
    out.append("\\toprule")
    if t.groups:
        cells, rules, col = [""] * ns, [], ns + 1
        for g, span in t.groups:
            cells.append(f"\\multicolumn{{{span}}}{{c}}{{\\textbf{{{tex_escape(g)}}}}}" if span > 1 else f"\\textbf{{{tex_escape(g)}}}")
            if span > 1:
                rules.append(f"\\cmidrule(lr){{{col}-{col + span - 1}}}")
            col += span
        out.append(" & ".join(cells) + " \\\\")
        if rules:
            out.append("".join(rules))
    out.append(" & ".join([f"\\textbf{{{tex_escape(h)}}}" for h in t.stub_heads] + [tex_escape(h) for h in t.heads]) + " \\\\")
    out.append("\\midrule")
    for r in t.rows:
        if r.rule_before:
            out.append("\\midrule")
        stub = [f"\\textbf{{{tex_escape(s)}}}" if r.shaded and i == 0 else tex_escape(s) for i, s in enumerate(r.stub)]
        line = " & ".join(stub + [cell_latex(c) for c in r.cells]) + " \\\\"
        out.append(("\\rowcolor{gray!15}" if r.shaded else "") + line)
    out += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    return "\n".join(out) + "\n"


def render_markdown_report(tables: list[Table]) -> str:
    return "\n".join(render_markdown(t) for t in tables)


def render_latex_report(tables: list[Table]) -> str:
    # Wide tables (many models, or paper figures beside ours) shrink to the page rather than overflow.
    body = "\n".join(
        render_latex(t).replace("\\begin{tabular}", "\\resizebox{\\ifdim\\width>\\linewidth\\linewidth\\else\\width\\fi}{!}{\\begin{tabular}")
        .replace("\\end{tabular}", "\\end{tabular}}")
        for t in tables
    )
    return standalone(body.replace("\\begin{table}[t]", "\\begin{table}[h]"), "MELT reproduction report")


def print_tables(tables, width: int | None = None) -> None:
    """Each table as a rich table: bold best, underlined second, the paper's figure dimmed beside ours.
    `width`: the console's (None: the terminal's, or rich's default where there is none)."""
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text

    console = Console(width=width)
    for t in map(_printable_table, tables):
        # Text, not str: rich reads a str's [brackets] as markup (a label "[/x]" would raise)
        rt = RichTable(title=Text(heading(t)), title_style="bold", show_lines=False)
        for h in t.stub_heads:
            rt.add_column(Text(h))
        k = 0
        for g, span in t.groups or [("", len(t.heads))]:
            for h in t.heads[k : k + span]:
                rt.add_column(Text(f"{g}\n{h}" if g and span > 1 else (g or h)), justify="right")
            k += span
        for r in t.rows:
            if r.rule_before:
                rt.add_section()
            cells = []
            for c in r.cells:
                shown = c.shown()
                text = Text(NA if shown is None else shown, style="dim" if shown is None else
                            "bold" if c.bold else "underline" if c.underline else "")
                if shown is not None and c.stderr is not None:
                    text.append(f" ±{c.stderr:.{c.digits}f}", style="dim")
                if (beside := paper_beside(c)) is not None:
                    text.append(f" ({beside})", style="cyan")
                cells.append(text)
            stub = [Text(s, style="bold" if r.shaded else "") for s in r.stub]
            rt.add_row(*stub, *cells, style="on grey15" if r.shaded else None)
        console.print(rt)
        if t.compare:
            console.print("Each cell: ours (paper, Δ = ours − paper).", style="cyan")
        for n in t.notes:
            console.print(f"- {n}", soft_wrap=True, markup=False)  # a note may name a file: no markup
        console.print()
