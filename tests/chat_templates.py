"""Chat templates of model families whose templates render tools, written for the tool-calling tests.

Each renders what its family's published template renders for `tools`, assistant `tool_calls` and role `tool`
messages (the same prompt text), so that rendering through them checks the conversation kvd hands a template.
"""

# Qwen2.5: the tools go into the system turn as one JSON line each inside <tools></tools>; an assistant's calls
# are <tool_call> blocks of {"name", "arguments"}; consecutive tool results share one user turn as
# <tool_response> blocks.
QWEN2_5 = """\
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- set system_text = messages[0].content if has_system else default_system -%}
{{- '<|im_start|>system\\n' + system_text -}}
{%- if tools -%}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' -}}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in messages -%}
    {%- if loop.first and has_system -%}
    {%- elif message.role == 'tool' -%}
        {%- set previous = messages[loop.index0 - 1].role if loop.index0 > 0 else '' -%}
        {%- if previous != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}
        {%- for call in message.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) -}}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# Llama 3.1 (3.2 and 3.3 render custom tools the same way): "Environment: ipython" in the system header when
# there are tools; the tools, each as indented JSON, go into the first user turn with the instruction to answer
# {"name", "parameters"}; an assistant's (single) call is that JSON object; tool results are `ipython` turns.
# Built-in tools (brave_search, wolfram_alpha) are called after <|python_tag|> and end with <|eom_id|>.
LLAMA3_1 = """\
{{- bos_token -}}
{%- if custom_tools is defined -%}{%- set tools = custom_tools -%}{%- endif -%}
{%- if tools is not defined -%}{%- set tools = none -%}{%- endif -%}
{%- set tools_in_user = tools_in_user_message if tools_in_user_message is defined else true -%}
{%- set today = date_string if date_string is defined else '26 Jul 2024' -%}
{%- set instruction = 'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    + 'and its value}.Do not use variables.\\n\\n' -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = messages[0].content | trim -%}
    {%- set messages = messages[1:] -%}
{%- else -%}
    {%- set system_text = '' -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}
{%- if builtin_tools is defined or tools is not none -%}{{- 'Environment: ipython\\n' -}}{%- endif -%}
{%- if builtin_tools is defined -%}
    {{- 'Tools: ' + builtin_tools | reject('equalto', 'code_interpreter') | join(', ') + '\\n\\n' -}}
{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + today + '\\n\\n' -}}
{%- if tools is not none and not tools_in_user -%}
    {{- 'You have access to the following functions. To call a function, please respond with JSON for a '
        + 'function call.' + instruction -}}
    {%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
{%- endif -%}
{{- system_text + '<|eot_id|>' -}}
{%- if tools is not none and tools_in_user -%}
    {%- if not messages -%}
        {{- raise_exception('Cannot put tools in the first user message when there is no first user message!') -}}
    {%- endif -%}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper '
        + 'arguments that best answers the given prompt.\\n\\n' + instruction -}}
    {%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
    {{- (messages[0].content | trim) + '<|eot_id|>' -}}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role in ['tool', 'ipython'] -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' -}}
        {%- if message.content is mapping or message.content is iterable -%}
            {{- message.content | tojson -}}
        {%- else -%}
            {{- message.content -}}
        {%- endif -%}
        {{- '<|eot_id|>' -}}
    {%- elif message.tool_calls is defined and message.tool_calls -%}
        {%- if message.tool_calls | length != 1 -%}
            {{- raise_exception('This model only supports single tool-calls at once!') -}}
        {%- endif -%}
        {%- set fn = message.tool_calls[0].function -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {%- if builtin_tools is defined and fn.name in builtin_tools -%}
            {{- '<|python_tag|>' + fn.name + '.call(' -}}
            {%- for name, value in fn.arguments | items -%}
                {{- name + '="' + value + '"' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
            {%- endfor -%}
            {{- ')' -}}
        {%- else -%}
            {{- '{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}' -}}
        {%- endif -%}
        {{- '<|eom_id|>' if builtin_tools is defined else '<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim)
            + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""

# Gemma 4: a system turn (with <|think|> when thinking is on) holds each tool as <|tool>declaration:NAME{...}<tool|>;
# an assistant's calls are <|tool_call>call:NAME{key:value,...}<tool_call|>, strings inside <|"|> quotes and keys
# bare; each result follows its call as <|tool_response>response:NAME{value:...}<tool_response|> in the same model
# turn, after which the model goes on in that turn; the generation prompt closes an empty thought channel when
# thinking is off.
GEMMA4 = """\
{%- macro value(v) -%}
    {%- if v is string -%}{{- '<|"|>' + v + '<|"|>' -}}
    {%- elif v is boolean -%}{{- 'true' if v else 'false' -}}
    {%- elif v is mapping -%}{{- '{' -}}{%- for k, x in v | dictsort -%}{{- k + ':' + value(x) -}}
        {%- if not loop.last -%},{%- endif -%}{%- endfor -%}{{- '}' -}}
    {%- elif v is sequence -%}{{- '[' -}}{%- for x in v -%}{{- value(x) -}}{%- if not loop.last -%},{%- endif -%}
        {%- endfor -%}{{- ']' -}}
    {%- elif v is none -%}{{- 'null' -}}
    {%- else -%}{{- v -}}{%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{{- bos_token or "" -}}
{%- set ns = namespace(rest=messages, last='') -%}
{%- if thinking or tools or (messages and messages[0].role == 'system') -%}
    {{- '<|turn>system\\n' -}}{%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}
    {%- if messages and messages[0].role == 'system' -%}
        {{- messages[0].content | trim -}}{%- set ns.rest = messages[1:] -%}
    {%- endif -%}
    {%- for tool in tools or [] -%}
        {{- '<|tool>declaration:' + tool.function.name + '{description:<|"|>' + (tool.function.description or '')
            + '<|"|>,parameters:' + value(tool.function.parameters) + '}<tool|>' -}}
    {%- endfor -%}
    {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for m in ns.rest -%}
    {%- if m.role == 'tool' -%}
        {{- '<|tool_response>response:' + (m.name or 'tool') + '{value:' + value(m.content) + '}<tool_response|>' -}}
        {%- set ns.last = 'tool' -%}
    {%- else -%}
        {%- if ns.last != 'tool' or m.role != 'assistant' -%}
            {%- if ns.last == 'tool' -%}{{- '<turn|>\\n' -}}{%- endif -%}
            {{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' -}}
        {%- endif -%}
        {{- (m.content or '') | trim -}}
        {%- for call in m.tool_calls or [] -%}
            {{- '<|tool_call>call:' + call.function.name + value(call.function.arguments) + '<tool_call|>' -}}
        {%- endfor -%}
        {%- if m.tool_calls -%}{%- set ns.last = 'tool' -%}{%- else -%}{{- '<turn|>\\n' -}}{%- set ns.last = '' -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.last != 'tool' -%}
    {{- '<|turn>model\\n' -}}{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""

# gpt-oss (OpenAI's harmony format): turns `<|start|>ROLE<|message|>...<|end|>`, the tools as a TypeScript-like
# namespace in the developer turn, an assistant's call as a message to `functions.NAME` on the commentary channel
# ending in <|call|>, a result as a message from that function; the generation prompt opens an assistant turn
# whose header the model writes.
HARMONY = """\
{%- set ns = namespace(last='') -%}
{{- '<|start|>system<|message|>You are ChatGPT.\\nReasoning: ' + (reasoning_effort or 'medium') + '\\n\\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if tools -%}
    {{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}
    {%- for tool in tools -%}
        {{- '\\n// ' + tool.function.description + '\\ntype ' + tool.function.name + ' = (_: ' -}}
        {{- tool.function.parameters | tojson + ') => any;\\n' -}}
    {%- endfor -%}
    {{- '\\n} // namespace functions<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'assistant' and m.tool_calls -%}
        {%- set call = m.tool_calls[0].function -%}
        {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' -}}
        {{- call.arguments | tojson + '<|call|>' -}}
        {%- set ns.last = call.name -%}
    {%- elif m.role == 'assistant' -%}
        {{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}
    {%- elif m.role == 'tool' -%}
        {{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>' -}}
        {{- m.content | tojson + '<|end|>' -}}
    {%- else -%}
        {{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""
