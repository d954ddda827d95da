"""The lab's cluster: what it builds from a stack (blueprint), up, apply and down (lifecycle), its
probes and checks (probes, served, check, report), rollouts under client load (upgrade), the
failures doctor is rehearsed against (faults, doctor), the endpoint's keys and CA (endpoint,
tlsca). The AWS lab builds on it."""
