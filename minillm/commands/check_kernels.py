"""`minillm check-kernels`: the Typer command; the checking and timing live in minillm.diagnostics.kernel_check."""
from pathlib import Path
from typing import Annotated

import typer

from minillm.commands.common import fail


def check_kernels_command(
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE", help="JSON lines appended here.")]
    = Path("results/kernels.jsonl"),
    quick: Annotated[bool, typer.Option("--quick", help="Fewer shapes and timings.")] = False,
    timing: Annotated[bool, typer.Option("--timing/--no-timing",
                                         help="Time the kernels against torch after checking.")] = True,
) -> None:
    """Check every CUDA attention kernel against its fp32 reference, then time it against torch (needs a GPU)."""
    import torch

    if not torch.cuda.is_available():
        fail("check-kernels needs a CUDA GPU: no GPU is visible (torch.cuda.is_available() is False)")
    from minillm.diagnostics.kernel_check import run_all

    passed, total, num_timings = run_all(output, quick, timing)
    typer.echo(f"{passed}/{total} cases passed; {num_timings} timings -> {output}")
    if passed < total:
        raise typer.Exit(1)
