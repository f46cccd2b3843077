"""YAX: trace JAX/Flax models into module expressions, query and rewrite them.

>>> import yax
>>> mox = yax.make_mox(model.apply)(variables, x)      # doctest: +SKIP
>>> yax.query('//module_call[@type="Dense"]', mox)      # doctest: +SKIP
"""

from yax._src.tools.cast import cast as cast
from yax._src.ir.check import InvariantError as InvariantError
from yax._src.ir.check import check_mox as check_mox
from yax._src.errors import AdapterFileError as AdapterFileError
from yax._src.errors import EvaluationError as EvaluationError
from yax._src.errors import PatternError as PatternError
from yax._src.errors import SignatureError as SignatureError
from yax._src.errors import SubstitutionError as SubstitutionError
from yax._src.errors import TraceError as TraceError
from yax._src.errors import TraceWarning as TraceWarning
from yax._src.errors import XPathError as XPathError
from yax._src.errors import YaxError as YaxError
from yax._src.trace.eval import Interpreter as Interpreter
from yax._src.report.explorer import to_model_explorer as to_model_explorer
from yax._src.report.export import export as export
from yax._src.tools.fewbit import fewbit as fewbit
from yax._src.trace.eval import eval_mox as eval_mox
from yax._src.ir.lower import to_jaxpr as to_jaxpr
from yax._src.ir.nodes import Equation as Equation
from yax._src.ir.nodes import Expr as Expr
from yax._src.ir.nodes import Literal as Literal
from yax._src.ir.nodes import Mox as Mox
from yax._src.ir.nodes import Symbol as Symbol
from yax._src.ir.nodes import Var as Var
from yax._src.trace.make import map_mox as map_mox
from yax._src.views import printing as _printing  # noqa: F401 - registers str(expr) with ``ir/nodes.py``
from yax._src.rewrite.pattern import Match as Match
from yax._src.rewrite.pattern import explain_match as explain_match
from yax._src.rewrite.pattern import group as group
from yax._src.rewrite.pattern import match as match
from yax._src.rewrite.pattern import trace_like as trace_like
from yax._src.tools.quantize import QuantizeResult as QuantizeResult
from yax._src.tools.quantize import quantize as quantize
from yax._src.tools.randomized import randomized_linear as randomized_linear
from yax._src.tools.remat import remat as remat
from yax._src.tools.lean_norm import lean_norm as lean_norm
from yax._src.views.query import query as query
from yax._src.views.serialize import dump_xml as dump_xml
from yax._src.views.serialize import dump_yson as dump_yson
from yax._src.views.serialize import to_dict as to_dict
from yax._src.views.serialize import to_json as to_json
from yax._src.tools.init_params import init_params as init_params
from yax._src.tools.keep import Kept as Kept
from yax._src.tools.keep import keep as keep
from yax._src.tools.lora import LoraResult as LoraResult
from yax._src.tools.lora import lora as lora
from yax._src.tools.lora import load_lora as load_lora
from yax._src.rewrite.engine import sub as sub
from yax._src.rewrite.recipe import Applied as Applied
from yax._src.rewrite.recipe import Recipe as Recipe
from yax._src.rewrite.recipe import recipe as recipe
from yax._src.report.summary import SummaryRow as SummaryRow
from yax._src.report.summary import summary as summary
from yax._src.report.summary import format_summary as format_summary
from yax._src.report.summary import print_table as print_summary
from yax._src.report.html import notebook_html as notebook_html
from yax._src.report.html import render_html as render_html
from yax._src.report.html import write_html as write_html
from yax._src.views.printing import pformat as pformat
from yax._src.report.memory import MemoryReport as MemoryReport
from yax._src.plan.fit_memory import MemoryPlan as MemoryPlan
from yax._src.plan.fit_memory import PlanRow as PlanRow
from yax._src.plan.fit_memory import fit_memory as fit_memory
from yax._src.report.memory import MemoryRow as MemoryRow
from yax._src.report.memory import memory_report as memory_report
from yax._src.trace.make import make_mox as make_mox

from yax._src.version import __version__ as __version__
