"""The ground floor: errors, counter-based random numbers, the generation geometry, the loop's protocol types
(plan, observer), hyper-parameter checks, settings parsing and the one registry helper. Imports nothing of dllm."""
