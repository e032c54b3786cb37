"""``--help`` for the entry points: every flag a user sets, grouped, and one-line flag errors.

absl's own ``--help`` lists only the main module's flags; the engine's and the sampling flags are
defined in `engine_flags`, so ``parse_flags`` answers ``--help`` with `grouped_help` instead: the
program's docstring, then the model/engine, cache, scheduler, parallelism and sampling flags, then
the program's own. ``--helpfull`` stays absl's (every flag by module, absl's included).
"""
import sys

from absl import app, flags

from jpaged.entrypoints.dataclass_flags import shown
from jpaged.entrypoints.engine_flags import flag_groups

HELP_ARGS = ("-h", "-?", "--help", "--helpshort")


def _usage(flag) -> str:
    if flag.flag_type() == "bool":
        return f"--[no]{flag.name}"
    if hasattr(flag.parser, "enum_values"):
        return f"--{flag.name}=<{'|'.join(flag.parser.enum_values)}>"
    return f"--{flag.name}=<{flag.flag_type()}>"


def _is_absl(module: str) -> bool:
    return module.startswith("absl.") or module == "absl"


def grouped_flags(flag_values: flags.FlagValues, prog: str) -> dict[str, list[str]]:
    """``{group: flag names}`` of the flags ``flag_values`` holds: the generated groups, then every
    other flag not defined by absl itself (the program's own, under ``prog``); empty groups dropped."""
    present = set(flag_values)
    groups = {g: [n for n in names if n in present] for g, names in flag_groups().items()}
    generated = {n for names in groups.values() for n in names}
    own = sorted(n for n in present - generated
                 if n == flag_values[n].name and not _is_absl(flag_values.find_module_defining_flag(n, "")))
    groups[prog] = own
    return {g: names for g, names in groups.items() if names}


def grouped_help(flag_values: flags.FlagValues, prog: str, doc: str | None) -> str:
    """The program's docstring and its flags by group, each with its help text and default (a
    generated flag's help already names the dataclass's default)."""
    generated = {n for names in flag_groups().values() for n in names}
    lines = [(doc or "").strip(), ""]
    for group, names in grouped_flags(flag_values, prog).items():
        lines.append(f"{group} flags:")
        for name in names:
            flag = flag_values[name]
            text = flag.help
            if hasattr(flag.parser, "enum_values"):  # absl puts the values first; the usage line has them
                text = text.removeprefix(f"<{'|'.join(flag.parser.enum_values)}>: ")
            if name not in generated and flag.default is not None:
                text += f" (default: {shown(flag.default)})"
            lines.append(f"  {_usage(flag)}")
            lines.append(flags.text_wrap(text, indent="      "))
        lines.append("")
    lines.append("--flagfile=FILE reads flags from a file; --helpfull lists every flag, absl's included.")
    return "\n".join(lines)


def parse_flags(argv: list[str], prog: str, doc: str | None, flag_values=flags.FLAGS) -> list[str]:
    """absl's parsing for ``app.run(main, flags_parser=...)``: ``--help`` prints `grouped_help` and
    exits 0, ``--helpfull`` absl's full help; a bad flag is one line ``{prog}: error: ...`` on stderr
    and exit status 2 (argparse's convention)."""
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(a in HELP_ARGS for a in args):
        print(grouped_help(flag_values, prog, doc))
        sys.exit(0)
    if "--helpfull" in args:
        app.usage(writeto_stdout=True, exitcode=0)
    try:
        return flag_values(argv)
    except flags.Error as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
