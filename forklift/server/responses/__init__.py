"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and GET / DELETE of stored
responses: the request body, its input items and options as chat's, the response object, its
streamed events, and the store behind `previous_response_id`."""
