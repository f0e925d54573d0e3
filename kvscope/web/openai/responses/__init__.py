"""OpenAI's Responses API (`/v1/responses`): its routes, its body, the response object
and its stream's events, and the responses it stores."""
