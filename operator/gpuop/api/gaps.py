"""What one backend's job cannot carry of a spec: the fields it refuses, each as the CRD's rule,
as ``auto``'s reason to pass the backend over, and as the render's refusal (one declaration,
three readings). Each backend declares its own (``JobApi.gaps``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gpuop._kits.schema import Problem, Rule, SpecError

if TYPE_CHECKING:
    from gpuop.api.spec import GpuTrainingSpec


@dataclasses.dataclass(frozen=True)
class SpecGap:
    """A spec field that one backend's job cannot carry: the CRD refuses the field with that
    backend (a CEL rule), ``auto`` passes that backend over for a spec that uses it, and
    rendering for it refuses the spec. Each backend declares its own (``JobApi.gaps``)."""

    backend: str
    field: str  # relative to spec, as the CRD's fieldPath wants it
    cel: str  # true when the spec uses the field
    used: Callable[[GpuTrainingSpec], bool]
    why: str

    @property
    def path(self) -> str:
        return f"spec{self.field}"

    @property
    def refusal(self) -> str:
        return f"cannot be used with backend {self.backend}: {self.why}"

    def rule(self) -> Rule:
        """The CRD's rule: the field is not used with this backend."""
        return Rule(
            cel=f"self.backend != '{self.backend}' || !({self.cel})",
            message=self.refusal,
            check=lambda s: {} if s.backend == self.backend and self.used(s) else None,
            field=self.field,
        )

    def problem(self, spec: GpuTrainingSpec) -> Problem | None:
        """The refusal, as a spec problem, when ``spec`` uses the field (whatever its backend)."""
        return Problem(self.path, self.refusal) if self.used(spec) else None


def gap_problems(gaps: Iterable[SpecGap], spec: GpuTrainingSpec) -> list[Problem]:
    """The refusals among ``gaps`` that ``spec`` meets, one problem each."""
    return [problem for gap in gaps if (problem := gap.problem(spec)) is not None]


def refuse_gaps(gaps: Iterable[SpecGap], spec: GpuTrainingSpec) -> None:
    """Raise SpecError naming each field among ``gaps`` that ``spec`` uses (a backend's render)."""
    if problems := gap_problems(gaps, spec):
        raise SpecError(problems)
