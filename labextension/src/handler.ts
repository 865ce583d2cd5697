/**
 * The lab's connection to the Workbench server extension: reconnecting websocket streams,
 * and a run's profiles over REST (the other endpoints under `/workbench/api/runs` serve
 * other clients and scripts).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { ListMessage, RunMessage, RunsPage } from './types';

const API = 'workbench/api';

/** The API path of a run; its id (already percent-encoded by the server where a folder
 * name needs it, e.g. `a%3Ab`) travels percent-encoded once more in one path segment. */
function runPath(id: string, ...rest: string[]): string {
  return ['runs', encodeURIComponent(id), ...rest].join('/');
}

/**
 * A websocket to a Workbench stream that reconnects with backoff. `path` is asked
 * again on every (re)connect, so a run stream resumes after the last step it has.
 */
export class Stream<M> {
  private _socket: WebSocket | null = null;
  private _timer = 0;
  private _delay = 500;
  private _disposed = false;

  constructor(
    private readonly _path: () => string,
    private readonly _onMessage: (msg: M) => void,
    private readonly _onStatus: (connected: boolean) => void = () => undefined
  ) {
    this._connect();
  }

  /** Closes the socket for good. */
  dispose(): void {
    this._disposed = true;
    window.clearTimeout(this._timer);
    this._socket?.close();
    this._socket = null;
  }

  /** Drops the socket and connects again now. */
  reconnect(): void {
    this._socket?.close();
  }

  private _connect(): void {
    if (this._disposed) {
      return;
    }
    const settings = ServerConnection.makeSettings();
    let url = URLExt.join(settings.wsUrl, API, this._path());
    if (settings.token) {
      url += `${url.includes('?') ? '&' : '?'}token=${encodeURIComponent(settings.token)}`;
    }
    const socket = new settings.WebSocket(url);
    this._socket = socket;
    socket.onopen = () => {
      this._delay = 500;
      this._onStatus(true);
    };
    socket.onmessage = ev => this._onMessage(JSON.parse(ev.data as string) as M);
    socket.onclose = () => {
      if (this._socket !== socket) {
        return;
      }
      this._onStatus(false);
      this._socket = null;
      if (!this._disposed) {
        this._timer = window.setTimeout(() => this._connect(), this._delay);
        this._delay = Math.min(this._delay * 2, 10000);
      }
    };
  }
}

/** The list stream: every run as it appears, changes or goes. */
export function listStream(
  onMessage: (msg: ListMessage) => void,
  onStatus?: (connected: boolean) => void
): Stream<ListMessage> {
  return new Stream<ListMessage>(() => 'stream', onMessage, onStatus);
}

/** A run stream resuming after `since()`: run.json changes and new metrics (`keys` only). */
export function runStream(
  id: string,
  since: () => number,
  onMessage: (msg: RunMessage) => void,
  keys: string[] = []
): Stream<RunMessage> {
  const q = keys.length ? `&keys=${encodeURIComponent(keys.join(','))}` : '';
  return new Stream<RunMessage>(() => `${runPath(id, 'stream')}?since=${since()}${q}`, onMessage);
}

/** The page of the runs list after `cursor` (`GET .../runs?cursor=`, the `next` of the
 * page before). */
export async function fetchRunsPage(cursor: string): Promise<RunsPage> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API, 'runs') + `?cursor=${encodeURIComponent(cursor)}`;
  const resp = await ServerConnection.makeRequest(url, {}, settings);
  if (!resp.ok) {
    throw new Error(`runs list page: ${resp.status} ${resp.statusText}`);
  }
  return (await resp.json()) as RunsPage;
}

/** A run's profiles (`GET .../runs/<id>/profiles`): the parsed JSON answer. */
export async function fetchProfiles(id: string): Promise<unknown> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API, runPath(id, 'profiles'));
  const resp = await ServerConnection.makeRequest(url, {}, settings);
  if (!resp.ok) {
    throw new Error(`profiles of ${id}: ${resp.status} ${resp.statusText}`);
  }
  return resp.json();
}
