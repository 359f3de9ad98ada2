"""LaTeX helpers shared by the tables: escaping and the standalone document around them."""

from __future__ import annotations

# Packages the tables need; a paper that pastes them needs the same (all in texlive-latex-base/recommended).
PREAMBLE = r"""\documentclass[10pt]{article}
\usepackage[a4paper,landscape,margin=1.5cm]{geometry}
\usepackage[T1]{fontenc}
\usepackage{booktabs}
\usepackage[table]{xcolor}
\usepackage{graphicx}
\usepackage{amssymb}
"""


def tex_escape(s: str) -> str:
    out = []
    for ch in s:
        out.append({"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "_": r"\_", "#": r"\#", "$": r"\$",
                    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                    "\u2020": r"$^\dagger$", "\u2212": "$-$", "\u00d7": r"$\times$",
                    "\u2713": r"$\checkmark$", "\u2717": r"$\times$", "\u2248": r"$\approx$"}.get(ch, ch))
    return "".join(out)


def standalone(body: str, title: str = "") -> str:
    """A complete document that compiles with pdflatex on its own."""
    head = f"\\section*{{{tex_escape(title)}}}\n" if title else ""
    return PREAMBLE + "\\begin{document}\n" + head + body + "\n\\end{document}\n"
