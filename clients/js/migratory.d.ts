// Type declarations of migratory.js, the JavaScript client (docs/clients.md).

export declare const PROTOCOL_VERSION: 3;
export declare const DEFAULT_WEIGHT: 100;

export declare const Status: Readonly<{
  OK: 0;
  DENIED: 1;
  FAILED: 2;
  NO_SUBSCRIBER: 3;
  INVALID_SUBJECT: 4;
  TOO_LARGE: 5;
  LIMIT_EXCEEDED: 6;
  REVOKED: 7;
  NOT_CONNECTED: 8;
  PROTOCOL_ERROR: 9;
}>;
export type StatusCode = (typeof Status)[keyof typeof Status];
export declare function statusName(code: number): string;

export declare const MessageType: Readonly<{ SNAPSHOT: "SNAPSHOT"; UPDATE: "UPDATE"; RECOVERED: "RECOVERED" }>;
export type MessageTypeName = (typeof MessageType)[keyof typeof MessageType];

export declare const EventKind: Readonly<{
  NOTIFY_SERVER_UP: "NOTIFY_SERVER_UP";
  NOTIFY_SERVER_DOWN: "NOTIFY_SERVER_DOWN";
  NOTIFY_DATA_SYNC: "NOTIFY_DATA_SYNC";
  NOTIFY_DATA_RESYNC: "NOTIFY_DATA_RESYNC";
  SUBSCRIBE_ALLOW: "SUBSCRIBE_ALLOW";
  SUBSCRIBE_DENY: "SUBSCRIBE_DENY";
  PUBLISH_OK: "PUBLISH_OK";
  PUBLISH_NO_SUBSCRIBER: "PUBLISH_NO_SUBSCRIBER";
  PUBLISH_DENIED: "PUBLISH_DENIED";
  PUBLISH_FAILED: "PUBLISH_FAILED";
  ERROR: "ERROR";
}>;
export type EventKindName = (typeof EventKind)[keyof typeof EventKind];

export interface Message {
  subject: string;
  content: Uint8Array;
  readonly text: string;
  fields: Record<string, string>;
  type: MessageTypeName;
  seq: number;
  epoch: number;
  retained: boolean;
}

export interface StatusEvent {
  kind: EventKindName;
  detail: string;
  subject: string;
  closure: string;
  status: StatusCode | null;
}

/** "WEIGHT URL", "URL" (weight 100), or [url, weight]. */
export type ServerEntry = string | [string, number];

export interface ClientOptions {
  token?: string;
  onMessage?: (message: Message) => void;
  onStatus?: (event: StatusEvent) => void;
  reconnect?: boolean;
  /** milliseconds */
  backoffInitial?: number;
  backoffMax?: number;
  requestTimeout?: number;
  /** "auto" (WebSocket, then HTTP streaming where WebSocket does not get through), or force one. */
  transport?: "auto" | "websocket" | "http-stream";
  /** A WebSocket implementation (Node without a global WebSocket). */
  WebSocket?: unknown;
  fetch?: typeof fetch;
}

export interface PublishOptions {
  fields?: Record<string, string>;
  closure?: string;
  retained?: boolean;
  guaranteed?: boolean;
  /** Names the publication across retries; a cluster numbers it once. Default: a new unique id. */
  publishId?: string;
  /** Times a FAILED publication is sent again (same publish id), once reconnected. */
  retries?: number;
}

export interface Publication extends PublishOptions {
  subject: string;
  content: string | Uint8Array | ArrayBuffer;
}

export interface PublishResult {
  /** The publication's place in the input (results come in the order the server answers). */
  index: number;
  publication: Publication;
  publishId: string;
  status: StatusCode;
  reason: string;
  /** 1, or more when a FAILED one was sent again. */
  attempts: number;
  /** OK or NO_SUBSCRIBER. */
  ok: boolean;
}

export interface PublishAllOptions {
  /** Publications awaiting their status at once (default 64). */
  window?: number;
  /** Publications a second at most (default 0: as fast as the window allows). */
  rate?: number;
  /** Times a FAILED one is sent again, same publish id (default 0). */
  retries?: number;
}

export declare class DecodeError extends Error {}

export declare class MigratoryClient {
  constructor(servers: ServerEntry[], options?: ClientOptions);
  readonly connected: boolean;
  readonly session: string;
  readonly server: string;
  readonly transportName: string;
  readonly maxMessageSize: number;
  readonly duplicatesDropped: number;
  connect(timeout?: number): Promise<void>;
  waitConnected(timeout?: number): Promise<void>;
  close(): void;
  /** [epoch, seq] of the last message received on the subject. */
  position(subject: string): [number, number] | null;
  subscribe(subjects: string[], options?: { conflationMs?: number }): Promise<Record<string, StatusCode>>;
  unsubscribe(subjects: string[]): void;
  publish(subject: string, content: string | Uint8Array | ArrayBuffer, options?: PublishOptions): Promise<StatusCode>;
  /** Pipelined publishing: one result per publication, in the order the server answers. */
  publishAll(
    publications: Iterable<Publication> | AsyncIterable<Publication>,
    options?: PublishAllOptions,
  ): AsyncGenerator<PublishResult, void, undefined>;
  newPublishId(): string;
  /** The next message, when no onMessage listener is set. */
  nextMessage(timeout?: number): Promise<Message>;
}

export declare function parseServers(servers: ServerEntry[]): { url: string; weight: number }[];
export declare function encodeConnect(token?: string, version?: number): Uint8Array;
export declare function encodeSubscribe(subjects: string[], conflationMs?: number, positions?: [number, number][] | null): Uint8Array;
export declare function encodeUnsubscribe(subjects: string[]): Uint8Array;
export declare function encodePublish(subject: string, content: string | Uint8Array, options?: PublishOptions): Uint8Array;
export declare function decodeServer(data: Uint8Array | ArrayBuffer): Record<string, unknown> & { op: string };
