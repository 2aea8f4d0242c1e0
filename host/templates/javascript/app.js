// {{name}}: an OBX plugin in JavaScript (ComponentizeJS).
//
// Command AddNote {"text"} stores a note and, in the same transaction, emits NoteAdded on
// {{name}}.events through the outbox. The plugin's own subscription to that topic marks
// the note seen: an event handler runs once per event, in a transaction of its own.
// Command GetNote {"id"} answers the note.

import { query, execute } from 'obx:plugin/sql@{{wit_version}}';
import { emit } from 'obx:plugin/outbox@{{wit_version}}';
import { log } from 'obx:plugin/log@{{wit_version}}';
import { declarePayload } from 'obx:plugin/contract@{{wit_version}}';

const TOPIC = '{{name}}.events';

// The JSON Schema of NoteAdded's payload: emit refuses one that breaks it, the event path
// parks one that breaks it, and `obx plugin test` sends the example to the handler.
const NOTE_ADDED = {
  type: 'object',
  required: ['id', 'text'],
  properties: { id: { type: 'string', format: 'uuid' }, text: { type: 'string' } },
};
const NOTE_ADDED_EXAMPLE = { id: '0b7e5c1a-9a8f-4c1e-8e5e-2f3b6c7d8e9f', text: 'hello' };

const MIGRATION_1 = `
CREATE TABLE notes (
    id         uuid        PRIMARY KEY,
    text       text        NOT NULL,
    seen       boolean     NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
)`;

// Handler errors are thrown as WIT variants.
const invalid = (message) => ({ tag: 'invalid-input', val: message });
const failed = (message) => ({ tag: 'failed', val: message });
const rejected = (code, message) => ({ tag: 'rejected', val: { code, message } });

// SQL values are variants too: { tag: 'text', val: '...' }, { tag: 'uuid', val: '...' }, ...
const text = (val) => ({ tag: 'text', val });
const uuid = (val) => ({ tag: 'uuid', val });

// An import that returns a result throws its error (in `payload`).
function sql(run) {
  try {
    return run();
  } catch (e) {
    const error = e.payload ?? e;
    if (error.tag === 'invalid') {
      throw invalid(error.val);
    }
    throw failed(`sql: ${JSON.stringify(error)}`);
  }
}

function textField(payload, name) {
  let value;
  try {
    value = JSON.parse(payload)[name];
  } catch (e) {
    throw invalid(`the payload is not JSON: ${e.message}`);
  }
  if (typeof value !== 'string' || value === '') {
    throw invalid(`needs a non-empty string "${name}"`);
  }
  return value;
}

function addNote(noteText) {
  const rows = sql(() =>
    query('INSERT INTO notes (id, text) VALUES (gen_random_uuid(), $1) RETURNING id', [text(noteText)]),
  );
  const id = rows.rows[0][0].val;
  try {
    emit({
      aggregateType: 'Note',
      aggregateId: id,
      eventType: 'NoteAdded',
      payload: JSON.stringify({ id, text: noteText }),
      topic: TOPIC,
    });
  } catch (e) {
    throw failed(`emit: ${JSON.stringify(e.payload ?? e)}`);
  }
  return JSON.stringify({ id });
}

function getNote(id) {
  const rows = sql(() => query('SELECT text, seen FROM notes WHERE id = $1', [uuid(id)]));
  if (rows.rows.length === 0) {
    throw rejected('no-such-note', `there is no note ${id}`);
  }
  const [noteText, seen] = rows.rows[0];
  return JSON.stringify({ id, text: noteText.val, seen: seen.val });
}

export const handler = {
  describe() {
    declarePayload(TOPIC, 'NoteAdded', JSON.stringify(NOTE_ADDED), JSON.stringify(NOTE_ADDED_EXAMPLE));
    return {
      name: '{{name}}',
      version: '0.1.0',
      commands: ['AddNote', 'GetNote'],
      subscriptions: [{ topic: TOPIC, eventTypes: ['NoteAdded'], mode: 'dedup' }],
      emits: [{ topic: TOPIC, eventType: 'NoteAdded' }],
      migrations: [{ id: 1, name: 'notes', sql: MIGRATION_1 }],
    };
  },

  handleCommand(command) {
    switch (command.name) {
      case 'AddNote':
        return addNote(textField(command.payload, 'text'));
      case 'GetNote':
        return getNote(textField(command.payload, 'id'));
      default:
        throw invalid(`unknown command ${command.name}`);
    }
  },

  handleEvent(event) {
    const id = textField(event.payload, 'id');
    const marked = sql(() => execute('UPDATE notes SET seen = true WHERE id = $1', [uuid(id)]));
    log('info', `note ${id} seen (${marked} row)`);
  },
};
