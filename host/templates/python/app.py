"""{{name}}: an OBX plugin in Python (componentize-py).

Command AddNote {"text"} stores a note and, in the same transaction, emits NoteAdded on
{{name}}.events through the outbox. The plugin's own subscription to that topic marks the
note seen: an event handler runs once per event, in a transaction of its own.
Command GetNote {"id"} answers the note.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import handler
from wit_world.imports import contract, log, outbox, sql, types

TOPIC = "{{name}}.events"

# The JSON Schema of NoteAdded's payload: emit refuses one that breaks it, the event path
# parks one that breaks it, and `obx plugin test` sends the example to the handler.
NOTE_ADDED = {
    "type": "object",
    "required": ["id", "text"],
    "properties": {"id": {"type": "string", "format": "uuid"}, "text": {"type": "string"}},
}
NOTE_ADDED_EXAMPLE = {"id": "0b7e5c1a-9a8f-4c1e-8e5e-2f3b6c7d8e9f", "text": "hello"}

MIGRATION_1 = """
CREATE TABLE notes (
    id         uuid        PRIMARY KEY,
    text       text        NOT NULL,
    seen       boolean     NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


def invalid(message: str) -> Err:
    """Invalid input: HTTP 400 for a command; an event is parked at once."""
    return Err(types.HandlerError_InvalidInput(message))


def failed(message: str) -> Err:
    """The handler could not complete: HTTP 500; an event is retried, then parked."""
    return Err(types.HandlerError_Failed(message))


def text_field(payload: str, name: str) -> str:
    try:
        value = json.loads(payload).get(name)
    except (ValueError, AttributeError):
        raise invalid("the payload is not a JSON object")
    if not isinstance(value, str) or not value:
        raise invalid(f"needs a non-empty string {name!r}")
    return value


def query(statement: str, params: list) -> sql.RowSet:
    """Runs a statement that returns rows; an SQL error fails the call (and rolls it back)."""
    try:
        return sql.query(statement, params)
    except Err as e:
        if isinstance(e.value, sql.SqlError_Invalid):
            raise invalid(e.value.value)
        raise failed(f"sql: {e.value}")


class Handler(exports.Handler):
    def describe(self) -> handler.Manifest:
        contract.declare_payload(TOPIC, "NoteAdded", json.dumps(NOTE_ADDED), json.dumps(NOTE_ADDED_EXAMPLE))
        return handler.Manifest(
            name="{{name}}",
            version="0.1.0",
            commands=["AddNote", "GetNote"],
            subscriptions=[
                handler.Subscription(topic=TOPIC, event_types=["NoteAdded"], mode=handler.DeliveryMode.DEDUP)
            ],
            emits=[handler.EventDeclaration(topic=TOPIC, event_type="NoteAdded")],
            migrations=[handler.Migration(id=1, name="notes", sql=MIGRATION_1)],
        )

    def handle_command(self, command: handler.Command) -> str:
        if command.name == "AddNote":
            return self.add_note(text_field(command.payload, "text"))
        if command.name == "GetNote":
            return self.get_note(text_field(command.payload, "id"))
        raise invalid(f"unknown command {command.name}")

    def add_note(self, text: str) -> str:
        rows = query(
            "INSERT INTO notes (id, text) VALUES (gen_random_uuid(), $1) RETURNING id",
            [types.SqlValue_Text(text)],
        )
        note_id = rows.rows[0][0].value  # a SqlValue_Uuid: its .value is the UUID text
        try:
            outbox.emit(
                outbox.Event(
                    event_id=None,
                    aggregate_type="Note",
                    aggregate_id=note_id,
                    event_type="NoteAdded",
                    payload=json.dumps({"id": note_id, "text": text}),
                    topic=TOPIC,
                    partition_key=None,
                )
            )
        except Err as e:
            raise failed(f"emit: {e.value}")
        return json.dumps({"id": note_id})

    def get_note(self, note_id: str) -> str:
        rows = query("SELECT text, seen FROM notes WHERE id = $1", [types.SqlValue_Uuid(note_id)])
        if not rows.rows:
            raise Err(types.HandlerError_Rejected(types.Rejection("no-such-note", f"there is no note {note_id}")))
        text, seen = rows.rows[0]
        return json.dumps({"id": note_id, "text": text.value, "seen": seen.value})

    def handle_event(self, event: handler.Event) -> None:
        note_id = text_field(event.payload, "id")
        try:
            marked = sql.execute("UPDATE notes SET seen = true WHERE id = $1", [types.SqlValue_Uuid(note_id)])
        except Err as e:
            raise failed(f"sql: {e.value}")
        log.log(log.Level.INFO, f"note {note_id} seen ({marked} row)")
