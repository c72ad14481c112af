"""A server restart loses no idle conversation: the next turn continues it with the same tokens as if nothing
happened; a record damaged while the server was down is reported and dropped, never loaded."""

import json
import urllib.error
import urllib.request


def generate(ports, **fields) -> dict:
    request = urllib.request.Request(f"http://{ports.http_url}/v2/models/mol2/generate", method="POST",
                                     data=json.dumps(fields).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


def test_restart_keeps_idle_conversations(served_dir, repository, server, start_server):
    kept = generate(server, text_input="before the restart", adapter="chat", max_tokens=3)["conversation_id_out"]
    control = generate(server, text_input="before the restart", adapter="chat", max_tokens=3)["conversation_id_out"]
    damaged = generate(server, text_input="to be damaged", adapter="coding", max_tokens=3)["conversation_id_out"]
    expected = generate(server, text_input="after", adapter="coding", max_tokens=5, conversation_id=control)

    record = served_dir / "conversations" / f"{damaged}.state"
    with start_server(repository) as restarted:  # a second server process on the same store
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.write_bytes(bytes(data))
        answer = generate(restarted, text_input="after", adapter="coding", max_tokens=5, conversation_id=kept)
        assert answer["text_output"] == expected["text_output"]
        refused = generate(restarted, text_input="hello?", adapter="chat", conversation_id=damaged)
        assert "damaged and has been dropped" in refused["error"]
        assert not record.exists()
