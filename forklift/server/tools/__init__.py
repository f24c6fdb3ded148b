"""Tool calls in chat and Responses requests: tools and tool_choice validated, the tools in the
prompt, the grammar that constrains calls, and the parsers that read calls back out of the
model's text."""
