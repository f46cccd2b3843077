"""YAX: trace JAX/Flax models into module expressions, query and rewrite them.

>>> import yax
>>> mox = yax.make_mox(model.apply)(variables, x)      # doctest: +SKIP
>>> yax.query('//module_call[@type="Dense"]', mox)      # doctest: +SKIP
"""

from yax._cast import cast as cast
from yax._check import InvariantError as InvariantError
from yax._check import check_mox as check_mox
from yax._errors import EvaluationError as EvaluationError
from yax._errors import PatternError as PatternError
from yax._errors import SignatureError as SignatureError
from yax._errors import SubstitutionError as SubstitutionError
from yax._errors import TraceError as TraceError
from yax._errors import TraceWarning as TraceWarning
from yax._errors import XPathError as XPathError
from yax._errors import YaxError as YaxError
from yax._eval import Interpreter as Interpreter
from yax._explorer import to_model_explorer as to_model_explorer
from yax._fewbit import fewbit as fewbit
from yax._eval import eval_mox as eval_mox
from yax._lower import to_jaxpr as to_jaxpr
from yax._ir import Equation as Equation
from yax._ir import Expr as Expr
from yax._ir import Literal as Literal
from yax._ir import Mox as Mox
from yax._ir import Symbol as Symbol
from yax._ir import Var as Var
from yax._trace import map_mox as map_mox
from yax import _printing  # noqa: F401 - registers str(expr) with ``_ir``
from yax._pattern import Match as Match
from yax._pattern import explain_match as explain_match
from yax._pattern import group as group
from yax._pattern import match as match
from yax._pattern import trace_like as trace_like
from yax._quantize import QuantizeResult as QuantizeResult
from yax._quantize import quantize as quantize
from yax._randomized import randomized_linear as randomized_linear
from yax._remat import remat as remat
from yax._query import query as query
from yax._serialize import dump_xml as dump_xml
from yax._serialize import dump_yson as dump_yson
from yax._serialize import to_dict as to_dict
from yax._serialize import to_json as to_json
from yax._init import init_params as init_params
from yax._lora import LoraResult as LoraResult
from yax._lora import lora as lora
from yax._sub import sub as sub
from yax._summary import SummaryRow as SummaryRow
from yax._summary import summary as summary
from yax._trace import make_mox as make_mox

from yax._version import __version__ as __version__
