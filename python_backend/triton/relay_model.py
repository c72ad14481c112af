"""The relay Triton model that stands in for a `mol2*` ensemble on a disaggregated prefill server (decoupled; its
model.py is python_backend/triton/templates/relay_model.py, copied in by `mol2 serve --role prefill`): each turn runs
python_backend/triton/front.py's Relay in a thread of its own, since it waits on the decode server. `pb` is passed in, so
it is tested without a server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ced.families import read_config
from ced.tokenization import ChatTokenizer

from ..core.seal import Sealer
from ..core.settings import ServingSettings, triton_parameters
from .bls import bls_call
from .front import PASSED_ON, STATELESS, Relay
from .metrics import Counters
from .token_link import TokenLinks
from .triton_io import Every, Outputs, failure_response, optional, requested_outputs, require_decoupled, response

# a stateful turn's text (or its ids, as the Responses API sends them), or a stateless request's whole chat / prompt
FIELDS = ("text_input", "_text_ids", *STATELESS, "conversation_id", "adapter", *PASSED_ON)


class RelayModel:
    def __init__(self, pb, model_config: dict):
        require_decoupled(pb, model_config, "relay")
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        parameters = triton_parameters(model_config)
        settings = ServingSettings.from_parameters(parameters)
        config = read_config(settings.model_dir)
        store = settings.open_store(config)  # this server's idle timeout and limits
        self.counters = Counters(pb, "relay")  # the bytes of state on the wire, each way
        sealer = Sealer.from_environment()
        self.links = TokenLinks(sealer)  # the streamed turns' tokens come on one stream (token_link.py)
        self.relay = Relay(bls_call(pb), store, parameters["router_model"], parameters["decode_url"],
                           parameters["decode_model"], sealer, count=self.counters.count,
                           tokenizer=ChatTokenizer(settings.model_dir), links=self.links)
        # Turns wait on the decode server: many run at once, each in its own thread.
        self.pool = ThreadPoolExecutor(max_workers=int(parameters.get("max_turns_in_flight", "64")))

    def execute(self, requests) -> None:
        for request in requests:
            fields = {name: optional(self.pb, request, name) for name in FIELDS}
            fields = {name: value for name, value in fields.items() if value is not None}
            self.pool.submit(self.serve, fields, request.get_response_sender(), requested_outputs(request))

    def finalize(self) -> None:
        self.pool.shutdown(wait=True)
        self.links.close()  # its request cancelled: the decode server ends it (or that server waits for it to stop)
        self.counters.close()

    def serve(self, fields: dict, sender, wanted: frozenset[str]) -> None:
        def send(outputs, final):
            flags = self.final if final else 0
            if outputs is None:
                sender.send(flags=flags)
            else:
                sender.send(response(self.pb, self.outputs.tensors(**outputs), wanted), flags=flags)

        # asked for each of decode's answers, Triton at most every CANCEL_CHECK_S (asking each time took a quarter of
        # a relay's CPU at 16 streams)
        ask = Every()
        try:
            self.relay.run(fields, send, lambda: ask.due() and sender.is_cancelled())
        except Exception as error:  # noqa: BLE001 - never leave a client waiting: its request ends with a message
            sender.send(failure_response(self.pb, error, "relay"), flags=self.final)
