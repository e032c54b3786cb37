"""The OpenAI tool fields of a chat request, checked, and the grammar of a forced call.

``tool_choice="required"`` or a named function decode under a grammar that admits only a JSON array
of ``{"name": ..., "arguments": {...}}`` (one item unless ``parallel_tool_calls``) naming the given
functions, whose arguments satisfy each function's ``parameters`` schema: the same format for every
model (as vLLM does for ``required``), so that a forced call needs no parser and is valid by
construction. ``"auto"`` leaves the model free and a tool parser reads its own format.
"""
import json
import re
from dataclasses import dataclass

from jpaged.sample.structured_output import json_after_marker
from jpaged.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128              # OpenAI's own limit on ``tools``
MAX_SCHEMA_DEPTH = 32        # nesting of one function's ``parameters``
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict          # a JSON schema of an object


@dataclass
class ToolRequest:
    """What a request asks of tools: ``choice`` is "none", "auto", "required" or "named"."""

    functions: list[Function]
    choice: str
    named: str | None = None
    parallel: bool = True
    template_tools: list[dict] | None = None  # the tools as the chat template gets them

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def function(self, name: str) -> Function | None:
        return next((f for f in self.functions if f.name == name), None)

    def callable_functions(self) -> list[Function]:
        return [self.function(self.named)] if self.choice == "named" else self.functions

    def calls_schema(self, functions: list[Function] | None = None) -> dict:
        """The JSON schema of the forced output: an array of calls to ``functions``."""
        items = [call_schema(f) for f in (functions or self.callable_functions())]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if not self.parallel or self.choice == "named":
            schema["maxItems"] = 1
        return schema

    def structured_outputs(self, reasoning_parser=None, functions: list[Function] | None = None
                           ) -> StructuredOutputsParams:
        """The grammar of a forced call; with a ReasoningParser, the thinking (free text up to its
        ``</think>``) comes first."""
        return answer_grammar(self.calls_schema(functions), reasoning_parser)


def answer_grammar(schema: dict, reasoning_parser=None) -> StructuredOutputsParams:
    """JSON under ``schema``, after the reasoning when there is a reasoning parser."""
    if reasoning_parser is None:
        return StructuredOutputsParams(json=schema)
    prefix = None if reasoning_parser.starts_in_reasoning else reasoning_parser.start
    return StructuredOutputsParams(grammar=json_after_marker(schema, reasoning_parser.end, prefix))


def call_schema(f: Function) -> dict:
    return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _depth(obj, limit: int, level: int = 0) -> bool:
    """Whether ``obj`` nests deeper than ``limit`` (iterative, so a hostile schema cannot recurse us out)."""
    stack = [(obj, level)]
    while stack:
        node, d = stack.pop()
        if d > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return False


def _function(tool, where: str) -> Function:
    import jsonschema

    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError(f"{where}: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function: expected an object with 'name' and 'parameters'")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"{where}.function.name={name!r}: must be 1-64 letters, digits, '_', '.' or '-'")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description: must be a string")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.function.parameters ({name}): must be a JSON schema object, "
                         f"got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"{where}.function.parameters ({name}): the arguments are an object, so 'type' must be "
                         f"'object', got {parameters.get('type')!r}")
    if _depth(parameters, MAX_SCHEMA_DEPTH):
        raise ValueError(f"{where}.function.parameters ({name}): nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{where}.function.parameters ({name}): not a valid JSON schema ({e.message})") from None
    except RecursionError:
        raise ValueError(f"{where}.function.parameters ({name}): nested too deeply") from None
    return Function(name, description, parameters)


def parse_tool_request(tools, tool_choice=None, parallel_tool_calls=None) -> ToolRequest | None:
    """The checked tool fields, or None when the request has no tools and no tool_choice (or "none"
    without tools). ValueError names the field: ``tools[3].function.name``, ``tool_choice``, ..."""
    if tools is None or tools == []:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ValueError(f"tool_choice={tool_choice!r}: needs tools")
    if not isinstance(tools, list):
        raise ValueError("tools: expected a list of {'type': 'function', 'function': ...} objects")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} functions; at most {MAX_TOOLS} are supported")
    functions, seen = [], {}
    for i, tool in enumerate(tools):
        f = _function(tool, f"tools[{i}]")
        if f.name in seen:
            raise ValueError(f"tools[{i}].function.name={f.name!r}: the same name as tools[{seen[f.name]}]")
        seen[f.name] = i
        functions.append(f)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls: must be a bool")
    named = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice={tool_choice!r}: must be one of {', '.join(TOOL_CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}")
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        named = tool_choice["function"].get("name")
        if named not in seen:
            raise ValueError(f"tool_choice.function.name={named!r}: not one of the tools")
        choice = "named"
    else:
        raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    template_tools = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters,
                                                        **({"description": f.description} if f.description else {})}}
                      for f in functions]
    return ToolRequest(functions, choice, named, True if parallel_tool_calls is None else parallel_tool_calls,
                       None if choice == "none" else template_tools)


def check_forced_grammar(request: ToolRequest, tokenizer, vocab_size: int, reasoning_parser=None):
    """The compiled grammar of a forced call (cached, so the engine's own compile is a hit); when the
    grammar engine refuses it, the ValueError names the function whose schema it cannot take."""
    from jpaged.sample.structured_output import compile_grammar

    spec = request.structured_outputs(reasoning_parser)
    try:
        compile_grammar(spec, tokenizer, vocab_size)
    except ValueError as whole:
        for f in request.callable_functions():
            try:
                compile_grammar(request.structured_outputs(reasoning_parser, [f]), tokenizer, vocab_size)
            except ValueError as e:
                i = request.functions.index(f)
                why = re.sub(r"^structured_outputs\.\w+: ", "", str(e))
                raise ValueError(f"tools[{i}].function.parameters ({f.name}): the grammar engine cannot take "
                                 f"this schema: {why}") from None
        raise ValueError(f"tools: the grammar engine cannot take these functions together: {whole}") from None
    return spec


def arguments_valid(function: Function, arguments: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(arguments, function.parameters)
        return True
    except jsonschema.ValidationError:
        return False


def template_messages(conversation: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` in the history with their JSON-text arguments as objects, which is
    what chat templates index (``tool_call.arguments | tojson``)."""
    out = []
    for i, m in enumerate(conversation):
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls: expected a list")
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}]: expected {{'function': {{'name', 'arguments'}}}}")
                arguments = fn.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON") from None
                fixed.append({**call, "type": "function", "function": {**fn, "arguments": arguments},
                              "name": fn["name"], "arguments": arguments})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def constrained_params(params, request: ToolRequest | None, reasoning_parser, tokenizer, vocab_size: int):
    """``params`` with the grammar a chat request needs: a forced call's (`check_forced_grammar`), or
    a JSON ``structured_outputs`` moved after the reasoning when there is a reasoning parser. The
    grammars are compiled here (cached), so a refused schema is a ValueError before the engine."""
    import dataclasses

    spec = params.structured_outputs
    if request is not None and request.forced:
        if spec is not None:
            raise ValueError("tool_choice: a forced tool call (required or a named function) cannot be combined "
                             "with response_format / structured_outputs")
        return dataclasses.replace(params, structured_outputs=check_forced_grammar(request, tokenizer, vocab_size,
                                                                                   reasoning_parser))
    if spec is not None and reasoning_parser is not None and (spec.json is not None or spec.json_object):
        schema = spec.json if spec.json is not None else {"type": "object"}
        return dataclasses.replace(params, structured_outputs=answer_grammar(schema, reasoning_parser))
    return params
