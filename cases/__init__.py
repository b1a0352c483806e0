"""Cases as data: distributions, layouts, the Case dataclass, input generation and named matrices."""

from cases.case import Case
from cases.distributions import DISTRIBUTIONS, Distribution, get_distribution
from cases.inputs import GDNInputs, make_inputs
from cases.layouts import LAYOUTS, Layout, get_layout
from cases.matrices import MATRICES, Matrix, get_matrix

__all__ = ["Case", "GDNInputs", "make_inputs", "Distribution", "DISTRIBUTIONS", "get_distribution", "Layout",
           "LAYOUTS", "get_layout", "Matrix", "MATRICES", "get_matrix"]
